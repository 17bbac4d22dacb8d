"""``hal bench``: a backend's KV writes, paged attention and dispatch cost against plain torch.

Every comparison runs its two sides alternately in one process (warm-up, then repeated
timed samples, ``backend.synchronize()`` around each, medians), so machine load hits both
alike and only the *ratio* is reported against a target:

- KV write: ``pool.set_kv`` throughput vs a plain ``copy_`` of the same bytes (target >= 0.5x);
- paged attention (decode, extend) vs ``torch.nn.functional.scaled_dot_product_attention``
  on the same K/V gathered densely (decode target: <= 1.5x the SDPA time);
- dispatch: a forward through hal's objects (metadata, validation, pool, kernel) vs the same
  backend's own write and attention ops called directly (target: <= 2% overhead);
- memory: split K/V bytes per token vs one buffer padded to max(head_dim, v_head_dim), for
  MiMo-V2-Flash's real dims;
- with ``--speculative``: plain greedy vs the MTP worker of ``hal.speculative`` (imported only then).

Writes ``results.md``, ``results.csv`` and ``results.png`` to ``--out``. The jobs live apart:
``measurement`` (the timing harness and a row), ``bench_kernels`` and ``bench_decoding`` (the
workloads), ``bench_report`` (the outputs); this module runs them and is ``hal bench``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable

import attrs
import torch

from hal.protocols import Backend
from hal.spec import ForwardMode
from hal.tools.bench_kernels import (
    BenchConfig,
    _Setup,
    bench_attention,
    bench_dispatch,
    bench_kv_write,
    bench_memory,
    mimo_pool_spec,
)
from hal.tools.bench_report import markdown_table, write_outputs
from hal.tools.cli import backend_from_args
from hal.tools.measurement import Measurement, PairTiming, time_pair


def run_benchmarks(backend: Backend, cfg: BenchConfig, *, speculative: bool = False, versus_transformers: bool = False,
                   versus_plain: bool = False, quick: bool = False,
                   log: Callable[[str], None] = print) -> list[Measurement]:
    """Every measurement, in table order."""
    layer = _Setup(backend, torch.float32, cfg).layer()
    dtype = backend.kv_dtype_for([layer, attrs.evolve(layer, sliding_window=cfg.window)], cfg.page_size,
                                 max_q_len=cfg.extend_len, batch_size=cfg.decode_batch)
    s = _Setup(backend, dtype, cfg)
    log(f"backend {backend.name!r} on {backend.device}, {str(dtype).replace('torch.', '')}, torch threads {torch.get_num_threads()}")
    results = bench_kv_write(s, 64) + bench_kv_write(s, cfg.write_tokens)
    results += [bench_attention(s, ForwardMode.DECODE), bench_attention(s, ForwardMode.EXTEND)]
    results += [bench_attention(s, ForwardMode.DECODE, window=cfg.window, kv_len=n) for n in cfg.window_kv_lens]
    results += bench_dispatch(s)
    results += bench_memory()
    if speculative:
        from hal.tools.bench_decoding import bench_speculative

        results += bench_speculative(backend, quick)
    if versus_plain:
        from hal.tools.bench_decoding import bench_vs_plain

        results += bench_vs_plain(backend, quick, log=log)
    if versus_transformers:
        from hal.tools.bench_decoding import bench_vs_transformers

        results += bench_vs_transformers(backend, quick, log=log)
    return results


def run(args: argparse.Namespace) -> int:
    """``hal bench``: print the table and write the result files; exit 0 (targets are reported, not enforced)."""
    if args.repeats is not None and args.repeats < 1:
        print(f"hal bench: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    if args.transformers and importlib.util.find_spec("transformers") is None:
        print("hal bench: --transformers needs transformers (pip install -e '.[oracle]' && "
              "pip install --no-deps transformers==5.25.0)", file=sys.stderr)
        return 3
    if importlib.util.find_spec("matplotlib") is None:
        print("hal bench: matplotlib is needed for results.png (pip install 'hal[bench]')", file=sys.stderr)
        return 3
    if args.threads is not None:
        if args.threads < 1:
            print(f"hal bench: --threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)  # an unwritable --out fails before the timing, not after
    cfg = BenchConfig.quick() if args.quick else BenchConfig()
    if args.repeats is not None:
        cfg = attrs.evolve(cfg, repeats=args.repeats)
    backend = backend_from_args(args)
    results = run_benchmarks(backend, cfg, speculative=args.speculative, versus_transformers=args.transformers,
                             versus_plain=args.plain, quick=args.quick)
    title = (f"hal bench: {backend.name} on {backend.device}{' (emulated)' if args.emulate else ''}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, ratios: median of {cfg.repeats} paired samples")
    print(markdown_table(results))
    for path in write_outputs(results, args.out, title):
        print(f"wrote {path}")
    missed = [m.name for m in results if m.met is False]
    if missed:
        print(f"targets missed: {'; '.join(missed)}")
    noisy = [f"{m.name} ({m.spread_text})" for m in results if m.noisy]
    if noisy:
        print(f"warning: the machine was too noisy to judge {len(noisy)} rows (paired ratios spread over more than "
              f"1.5x, or across the target); rerun with more --repeats on a quieter machine: {'; '.join(noisy)}")
    return 0


__all__ = [
    "BenchConfig",
    "Measurement",
    "PairTiming",
    "bench_memory",
    "markdown_table",
    "mimo_pool_spec",
    "run",
    "run_benchmarks",
    "time_pair",
    "write_outputs",
]
