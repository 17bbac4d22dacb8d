"""Native checks and timings of the CUDA backend on an NVIDIA GPU.

    python benchmarks/cuda_check.py            # conformance + timings
    python benchmarks/cuda_check.py --quick    # fewer conformance cases and sizes

1. Conformance: the ``hal.tools.testing`` cases (every forward mode, sinks, SWA, hybrid SWA pool, GQA,
   qk != v and non-power-of-two dims, pages 16 and 64, fp32 / fp16 / bf16) run natively and are
   compared with the oracle (hal.oracle).
2. Attention: the Triton paged kernel vs dense ``scaled_dot_product_attention`` over the same K/V
   gathered out of the pages beforehand (decode and prefill), after checking they agree.
3. Split-KV: decode with MiMo-V2-Flash's full-layer heads at TP 4 (16 q heads, 1 kv head, qk 192,
   v 128), kv 1k-32k, batch 1-64: the kernel with its split-KV dispatch vs the same kernel forced to
   one pass vs dense SDPA (V padded to 192) over the gathered K/V; target: split >= 3x single-pass at
   batch 1, kv 32k.
4. Graphs: ``hal.GraphRunner`` replay vs eager for batch sizes 1..64 of a small decode step,
   after checking replay outputs equal eager outputs; target: replay >= 3x eager at batch <= 8.

Timings are medians of repeated runs measured with CUDA events; the tables print ratios.
``--emulate`` runs the same code paths with tiny sizes in the Triton CPU interpreter (timings
meaningless there): a dry run of this script on a machine without a GPU.
Exit status: 0 all checks passed, 1 a check failed, 2 no usable GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import torch

import hal  # installed: backends/ imports as hal.backends only from an install
from hal.allocator import KVAllocator, RequestPageTable
from hal.errors import BackendUnavailableError
from hal.metadata import build_metadata
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec
from hal.tools.testing import run_attention_case, standard_attention_cases


def _backend(emulate: bool) -> hal.Backend:
    if not emulate and os.environ.get("TRITON_INTERPRET") == "1":
        raise BackendUnavailableError("TRITON_INTERPRET=1 is set, so Triton would interpret instead of compiling; unset it")
    be = hal.get_backend("cuda", emulate=emulate)
    if not emulate and be.device.type != "cuda":
        raise BackendUnavailableError(f"the cuda backend runs on {be.device}, not a GPU (emulation installed?)")
    return be


def median_ms(be: hal.Backend, fn: Callable[[], object], *, warmup: int = 3, reps: int = 20) -> float:
    """Median wall time of ``fn`` in ms: CUDA events on a GPU, perf_counter under emulation."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if be.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _table(title: str, header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for r in [header, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


# -- 1. conformance -------------------------------------------------------------------------------
def check_conformance(be: hal.Backend, quick: bool, emulate: bool) -> int:
    if emulate:
        cases = standard_attention_cases(dtypes=(torch.float32,), head_dims=((48, 40),), heads=((4, 1),))
    else:
        cases = standard_attention_cases(
            dtypes=(torch.float32, torch.float16, torch.bfloat16),
            page_sizes=(16,) if quick else (16, 64),
            head_dims=((192, 128), (48, 40)) if quick else ((64, 32), (128, 128), (192, 128), (48, 40)),
            heads=((4, 1), (8, 2)) if quick else ((4, 1), (4, 4), (8, 2), (16, 1)),
        )
    failures = []
    worst: dict[torch.dtype, float] = {}
    for case in cases:
        result = run_attention_case(be, case)
        worst[case.dtype] = max(worst.get(case.dtype, 0.0), result.max_abs_err)
        if not result.passed:
            failures.append(f"  FAIL {case.describe()}: {result.detail}")
    print(f"conformance: {len(cases) - len(failures)}/{len(cases)} cases match the oracle")
    for dtype, err in worst.items():
        print(f"  max |err| {str(dtype).replace('torch.', '')}: {err:.3g}")
    for line in failures[:20]:
        print(line)
    return len(failures)


# -- shared set-up: a pool filled with random K/V, requests with given lengths ---------------------
def _filled(be: hal.Backend, layer: LayerSpec, kv_lens: list[int], page_size: int, dtype: torch.dtype, extra_tokens: int = 0):
    pages = sum(-(-(n + extra_tokens) // page_size) for n in kv_lens) + 1
    spec = KVPoolSpec(1, pages * page_size, page_size, layer.num_kv_heads, layer.head_dim, layer.v_head_dim, dtype)
    pool = be.create_kv_pool(spec)
    table = RequestPageTable(KVAllocator(pool))
    gen = torch.Generator(device=be.device).manual_seed(0)
    for r, n in enumerate(kv_lens):
        table.reserve(r, n + extra_tokens)
        k = torch.randn(n, layer.num_kv_heads, layer.head_dim, generator=gen, device=be.device).to(dtype)
        v = torch.randn(n, layer.num_kv_heads, layer.v_head_dim, generator=gen, device=be.device).to(dtype)
        pool.set_kv(0, table.slots(r, range(n)).to(be.device), k, v)
    return pool, table


# -- 2. Triton paged attention vs dense SDPA on gathered K/V --------------------------------------
def bench_attention(be: hal.Backend, quick: bool, emulate: bool) -> int:
    import torch.nn.functional as F

    dtype = torch.float32 if emulate else torch.bfloat16
    hq, hkv, d = (4, 2, 32) if emulate else (32, 8, 128)
    layer = LayerSpec(0, hq, hkv, d, d, scaling=d**-0.5)
    if emulate:
        configs = [("decode", 4, 1, 64, 16), ("prefill", 1, 32, 32, 16)]
    else:
        configs = [(mode, b, q, kv, ps) for ps in (16, 64) for mode, b, q, kv in (
            ("decode", 1, 1, 4096), ("decode", 32, 1, 2048), ("decode", 64, 1, 8192),
            ("prefill", 1, 2048, 2048), ("prefill", 4, 1024, 1024),
        )]
        if quick:
            configs = configs[:5]
    rows, failures = [], 0
    for name, b, q_len, kv_len, ps in configs:
        pool, table = _filled(be, layer, [kv_len] * b, ps, dtype)
        mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.EXTEND
        md = build_metadata(
            mode, kv_lens=[kv_len] * b, q_lens=[q_len] * b, page_table=table.table(range(b)),
            out_cache_loc=torch.zeros(b * q_len, dtype=torch.int64), pool=pool,
        )
        attn = be.create_attention(pool)
        plan = attn.plan(md)  # once, outside the timed calls, as an engine plans once per forward
        gen = torch.Generator(device=be.device).manual_seed(1)
        q = torch.randn(b * q_len, hq, d, generator=gen, device=be.device).to(dtype)
        # Dense copies of exactly the K/V the paged kernel reads (gathered once, not timed).
        pages = md.block_table.long()
        k_dense = pool.k_buffer(0)[pages].reshape(b, -1, hkv, d)[:, :kv_len].transpose(1, 2).contiguous()
        v_dense = pool.v_buffer(0)[pages].reshape(b, -1, hkv, d)[:, :kv_len].transpose(1, 2).contiguous()
        q_dense = q.view(b, q_len, hq, d).transpose(1, 2)

        def paged() -> torch.Tensor:
            return attn.forward(q, q[:, :hkv], q[:, :hkv], layer, plan, save_kv_cache=False)

        def dense() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q_dense, k_dense, v_dense, is_causal=q_len > 1, scale=layer.scaling, enable_gqa=True
            )

        got = paged().float()
        expect = dense().transpose(1, 2).reshape(b * q_len, hq, d).float()
        err = float((got - expect).abs().max())
        ok = err < (2e-3 if dtype == torch.float32 else 3e-2)
        failures += not ok
        t_paged, t_dense = median_ms(be, paged), median_ms(be, dense)
        rows.append((name, str(b), str(q_len), str(kv_len), str(ps), f"{t_paged:.3f}", f"{t_dense:.3f}",
                     f"{t_dense / t_paged:.2f}", f"{err:.2g}" + ("" if ok else " FAIL")))
    _table(
        f"Triton paged attention vs dense SDPA on gathered K/V ({str(dtype).replace('torch.', '')}, "
        f"q{hq}/kv{hkv}, d{d}; ratio > 1: Triton faster)",
        ("mode", "batch", "q_len", "kv_len", "page", "triton ms", "sdpa ms", "sdpa/triton", "max|diff|"),
        rows,
    )
    return failures


# -- 3. split-KV vs single pass vs SDPA --------------------------------------------------------------
def bench_split_kv(be: hal.Backend, quick: bool, emulate: bool) -> int:
    import torch.nn.functional as F

    from hal.backends.cuda.triton_attention import paged_attention, split_count, tile_sizes

    dtype = torch.float32 if emulate else torch.bfloat16
    hq, hkv, dk, dv, ps = (4, 1, 48, 40, 16) if emulate else (16, 1, 192, 128, 64)
    layer = LayerSpec(0, hq, hkv, dk, dv, scaling=dk**-0.5)
    if emulate:
        shapes = [(1, 256), (2, 512)]
    else:
        shapes = [(b, kv) for kv in (1024, 4096, 32768) for b in (1, 8, 64)] if not quick else [(1, 32768), (8, 4096), (64, 1024)]
    sm = 132 if emulate else torch.cuda.get_device_properties(be.device).multi_processor_count
    rows, failures = [], 0
    for b, kv_len in shapes:
        pool, table = _filled(be, layer, [kv_len] * b, ps, dtype)
        md = build_metadata(ForwardMode.DECODE, kv_lens=[kv_len] * b, q_lens=[1] * b, page_table=table.table(range(b)),
                            out_cache_loc=torch.zeros(b, dtype=torch.int64), pool=pool)
        gen = torch.Generator(device=be.device).manual_seed(4)
        q = torch.randn(b, hq, dk, generator=gen, device=be.device).to(dtype)
        args = (q, pool.k_buffer(0), pool.v_buffer(0), md.block_table, md.kv_lens, md.cu_q_lens)
        block_q, block_n = tile_sizes(1, hq // hkv, dk, dv)
        splits = split_count((b // block_q + b) * hkv, md.block_table.shape[1] * ps, block_n, sm)

        def run(n: int | None) -> Callable[[], torch.Tensor]:
            return lambda: paged_attention(*args, scaling=layer.scaling, sliding_window=None, sinks=None, query_rows_hint=1, num_splits=n)

        pages = md.block_table.long()
        k_dense = pool.k_buffer(0)[pages].reshape(b, -1, hkv, dk)[:, :kv_len].transpose(1, 2).contiguous()
        v_dense = F.pad(pool.v_buffer(0)[pages].reshape(b, -1, hkv, dv)[:, :kv_len].transpose(1, 2), (0, dk - dv)).contiguous()
        q_dense = q.view(b, 1, hq, dk).transpose(1, 2)

        def dense() -> torch.Tensor:
            return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=layer.scaling, enable_gqa=True)[..., :dv]

        split_out, single_out = run(None)().float(), run(1)().float()
        expect = dense().transpose(1, 2).reshape(b, hq, dv).float()
        err = max(float((split_out - expect).abs().max()), float((single_out - expect).abs().max()))
        ok = err < (2e-3 if dtype == torch.float32 else 3e-2)
        failures += not ok
        t_split, t_single, t_dense = median_ms(be, run(None)), median_ms(be, run(1)), median_ms(be, dense)
        target = " (target >= 3)" if (b, kv_len) == (1, 32768) else ""
        rows.append((str(b), str(kv_len), str(splits), f"{t_split:.3f}", f"{t_single:.3f}", f"{t_dense:.3f}",
                     f"{t_single / t_split:.2f}{target}", f"{t_dense / t_split:.2f}", f"{err:.2g}" + ("" if ok else " FAIL")))
    _table(
        f"split-KV decode vs single pass vs SDPA ({str(dtype).replace('torch.', '')}, q{hq}/kv{hkv}, qk {dk} / v {dv}, "
        f"pages of {ps}, {sm} SMs; ratios > 1: split faster)",
        ("batch", "kv_len", "splits", "split ms", "single ms", "sdpa ms", "single/split", "sdpa/split", "max|diff|"),
        rows,
    )
    return failures


# -- 4. CUDA graph replay vs eager -----------------------------------------------------------------
def bench_graphs(be: hal.Backend, quick: bool, emulate: bool) -> int:
    batch_sizes = [1, 2, 4] if emulate else ([1, 8, 64] if quick else [1, 2, 4, 8, 16, 32, 64])
    failures, _ = graph_replay_vs_eager(be, batch_sizes, emulate)
    return failures


def graph_vs_eager(be: hal.Backend, batch_sizes: list[int], *, rehearse: bool) -> dict[str, float]:
    """eager ms / graph ms per decode step at each batch size (``AssertionError`` if a replay differs)."""
    failures, ratios = graph_replay_vs_eager(be, batch_sizes, rehearse)
    if failures:
        raise AssertionError(f"{failures} graph replay(s) differ from the eager step")
    return ratios


def graph_replay_vs_eager(be: hal.Backend, batch_sizes: list[int], emulate: bool) -> tuple[int, dict[str, float]]:
    """A 4-layer decode step (2 in the interpreter) through ``hal.GraphRunner`` and eagerly, per batch
    size: the table, the failures (replay != eager) and eager/graph time per batch."""
    dtype = torch.float32 if emulate else torch.bfloat16
    hidden, hq, hkv, d, num_layers, ps = (64, 4, 2, 16, 2, 16) if emulate else (512, 8, 2, 64, 4, 16)
    layers = [LayerSpec(i, hq, hkv, d, d, scaling=d**-0.5, sliding_window=127 if i % 2 else None) for i in range(num_layers)]
    kv_len = 40 if emulate else 512
    max_b = batch_sizes[-1]
    pages = max_b * (-(-(kv_len + 1) // ps)) + 1
    spec = KVPoolSpec(num_layers, pages * ps, ps, hkv, d, d, dtype)
    pool = be.create_kv_pool(spec)
    table = RequestPageTable(KVAllocator(pool))
    gen = torch.Generator(device=be.device).manual_seed(2)
    for r in range(max_b):
        table.reserve(r, kv_len + 1)
        loc = table.slots(r, range(kv_len)).to(be.device)
        for layer in layers:
            pool.set_kv(layer.layer_id, loc, *(torch.randn(kv_len, hkv, d, generator=gen, device=be.device).to(dtype) for _ in range(2)))
    attn = be.create_attention(pool)
    qkv = [torch.nn.Linear(hidden, (hq + 2 * hkv) * d, bias=False, device=be.device, dtype=dtype) for _ in layers]
    proj = [torch.nn.Linear(hq * d, hidden, bias=False, device=be.device, dtype=dtype) for _ in layers]

    @torch.no_grad()
    def step(inputs: Mapping[str, torch.Tensor], md: hal.AttentionMetadata) -> torch.Tensor:
        x = inputs["x"]
        plan = attn.plan(md)
        for layer, w_in, w_out in zip(layers, qkv, proj):
            q, k, v = w_in(x).split([hq * d, hkv * d, hkv * d], dim=-1)
            t = x.shape[0]
            o = attn.forward(q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d), layer, plan)
            x = x + w_out(o.reshape(t, hq * d))
        return x

    runner = hal.GraphRunner(
        be, step, attention=attn, mode=ForwardMode.DECODE, tokens_per_request=1, batch_sizes=batch_sizes,
        max_pages_per_request=-(-(kv_len + 1) // ps), inputs={"x": ((hidden,), dtype)},
    )
    runner.capture()
    rows, failures, ratios = [], 0, {}
    for b in batch_sizes:
        md = build_metadata(
            ForwardMode.DECODE, kv_lens=[kv_len + 1] * b, q_lens=[1] * b, page_table=table.table(range(b)),
            out_cache_loc=torch.cat([table.slots(r, [kv_len]) for r in range(b)]), pool=pool,
        )
        inputs = {"x": torch.randn(b, hidden, generator=gen, device=be.device).to(dtype)}
        eager_out = step(inputs, md).clone()
        graph_out = runner.run(inputs, md).clone()
        err = float((graph_out.float() - eager_out.float()).abs().max())
        ok = err <= 1e-2 * max(1.0, float(eager_out.float().abs().max()))
        failures += not ok
        t_eager = median_ms(be, lambda: step(inputs, md))
        t_graph = median_ms(be, lambda: runner.run(inputs, md))
        target = " (target >= 3)" if b <= 8 else ""
        ratios[f"batch {b}"] = round(t_eager / t_graph, 2)
        rows.append((str(b), f"{t_eager:.3f}", f"{t_graph:.3f}", f"{t_eager / t_graph:.2f}{target}", f"{err:.2g}" + ("" if ok else " FAIL")))
    _table(
        f"GraphRunner replay vs eager: {num_layers}-layer decode step, hidden {hidden}, kv_len {kv_len} "
        f"({str(dtype).replace('torch.', '')}; ratio > 1: graph faster)",
        ("batch", "eager ms", "graph ms", "eager/graph", "max|diff|"),
        rows,
    )
    return failures, ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer conformance cases and sizes")
    parser.add_argument("--emulate", action="store_true", help="dry run in the Triton CPU interpreter (no GPU)")
    args = parser.parse_args(argv)
    try:
        be = _backend(args.emulate)
    except BackendUnavailableError as exc:
        print(f"cuda_check needs an NVIDIA GPU with a CUDA build of torch and triton: {exc}", file=sys.stderr)
        return 2
    print(f"{be!r}: {be.probe().reason}; torch {torch.__version__}")
    failures = check_conformance(be, args.quick, args.emulate)
    failures += bench_attention(be, args.quick, args.emulate)
    failures += bench_split_kv(be, args.quick, args.emulate)
    failures += bench_graphs(be, args.quick, args.emulate)
    print(f"\n{'all checks passed' if not failures else f'{failures} check(s) FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
