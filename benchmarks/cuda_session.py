"""One step of the GPU session (``benchmarks/cuda_session.sh`` runs them in order, each in its own
process under its own time limit): it appends one JSON line to ``OUT/results.jsonl`` when it ends
(``name``, ``ok``, ``seconds``, ``figures``, ``error``), so a killed session keeps every result
before it.

    python benchmarks/cuda_session.py STEP --out OUT [--rehearse] [--checkpoint DIR]

``--rehearse``: the same code on the CPU, the Triton kernels in the interpreter and tiny shapes
(``tests/tools/test_benchmark_scripts.py`` runs the whole session so), so that a Python error, a
missing file or a wrong flag never costs device time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hal
from hal import ForwardMode, LayerSpec
from hal.oracle import paged_oracle
from hal.tools.conformance import Status, build_suite, new_row_key_cases, run_suite, tree_cases
from hal.tools.testing import AttentionCase, run_attention_case

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_check  # noqa: E402  (its filled-pool helper and timing)

BF16, FP16 = torch.bfloat16, torch.float16


def backend(args: argparse.Namespace) -> hal.Backend:
    return hal.get_backend("cuda", emulate=args.rehearse)


def compiled_variants() -> int:
    """Triton variants of hal's kernels compiled so far in this process (0 in the interpreter)."""
    from hal.backends.cuda import triton_attention as kernels

    count = 0
    for kernel in (kernels._paged_attention_kernel, kernels._combine_splits_kernel, kernels._find_request):
        for cache in getattr(kernel, "device_caches", {}).values():
            count += len(cache[0]) if isinstance(cache, tuple) else len(cache)
    return count


def step_environment(args: argparse.Namespace) -> dict[str, Any]:
    import triton

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    info["hal info"] = subprocess.run([sys.executable, "-m", "hal.tools.cli", "info"], capture_output=True, text=True,
                                      timeout=120).stdout.strip().splitlines()
    return info


def correctness_cases(rehearse: bool) -> list[AttentionCase]:
    """What users run, few enough to compile in a minute: bf16 and fp16, pages of 16 and 128, window,
    sinks, GQA, qk 192 / v 128, chain verify, extend, decode."""
    cases = []
    shapes = ((128, 128, 8, 2), (192, 128, 8, 1)) if not rehearse else ((32, 32, 4, 2), (48, 32, 4, 1))
    for i, (dk, dv, hq, hkv) in enumerate(shapes):
        for dtype, ps in ((BF16, 16), (FP16, 128)):
            for mode, kv, q in ((ForwardMode.DECODE, (2 * ps + 3, 1, ps + 1), (1, 1, 1)),
                                (ForwardMode.TARGET_VERIFY, (2 * ps + 3, ps + 2, 4), (4, 4, 4)),
                                (ForwardMode.EXTEND, (2 * ps + 3, 7), (5, 7))):
                layer = LayerSpec(0, hq, hkv, dk, dv, scaling=dk**-0.5, sliding_window=5 if i else None, has_sinks=bool(i))
                cases.append(AttentionCase(mode, layer, kv, q, ps, dtype, hybrid=bool(i), seed=len(cases)))
    return cases


def step_correctness(args: argparse.Namespace) -> dict[str, Any]:
    """The Triton kernel and the CUDA pool's writes against ``hal.oracle`` on the device; trees, NaN
    in slots no row sees and in a new row's key; split-KV on and off."""
    be = backend(args)
    failures: list[str] = []
    checked = 0
    started = time.perf_counter()
    for case in correctness_cases(args.rehearse):
        for poison in (False, True):
            result = run_attention_case(be, case, poison_unseen=poison)
            checked += 1
            if not result.passed:
                failures.append(f"{case.describe()}{' (poisoned)' if poison else ''}: {result.detail}")
    for case in [c for c in tree_cases(quick=True) + new_row_key_cases() if c.dtype != torch.float32][: 2 if args.rehearse else 6]:
        result = run_attention_case(be, case, poison_new_key=case.tree_parents is None)
        checked += 1
        if not result.passed:
            failures.append(f"{case.describe()}: {result.detail}")
    from hal.backends.cuda.triton_attention import paged_attention

    gen = torch.Generator().manual_seed(3)
    ps, hkv, hq, dk, dv, pages = 16, 1, 8, (192 if not args.rehearse else 48), (128 if not args.rehearse else 32), 64
    k_cache = torch.randn(pages + 1, ps, hkv, dk, generator=gen).to(be.device, BF16)
    v_cache = torch.randn(pages + 1, ps, hkv, dv, generator=gen).to(be.device, BF16)
    table = (torch.randperm(pages, generator=gen) + 1).to(torch.int32)[None].to(be.device)
    call = (torch.randn(1, hq, dk, generator=gen).to(be.device, BF16), k_cache, v_cache, table,
            torch.tensor([1000], dtype=torch.int32, device=be.device), torch.tensor([0, 1], dtype=torch.int32, device=be.device))
    expect = paged_oracle(*(t.cpu() for t in call), scaling=dk**-0.5, sliding_window=None, sinks=None)
    for splits in (1, 4):
        got = paged_attention(*call, scaling=dk**-0.5, sliding_window=None, sinks=None, query_rows_hint=1, num_splits=splits)
        checked += 1
        if not torch.allclose(got.cpu().double(), expect, atol=3e-2, rtol=3e-2):
            failures.append(f"split-KV with {splits} split(s) differs from the oracle")
    if failures:
        raise AssertionError(f"{len(failures)} of {checked} checks failed; first: {failures[0]}")
    return {"checks": checked, "compiled variants": compiled_variants(), "seconds incl. compiling": round(time.perf_counter() - started, 1)}


def step_graphs(args: argparse.Namespace) -> dict[str, Any]:
    """CUDA graphs: capture decode and chain/tree verify (and the draft steps), replay with another
    batch each time, equal to eager: the conformance kit's graph loops, on the device."""
    results = run_suite(backend(args), build_suite(quick=True, select=["graph"]))
    failed = [r for r in results if r.status is Status.FAILED]
    if failed:
        raise AssertionError(f"{len(failed)} of {len(results)} graph checks failed; first: {failed[0].check.name}: {failed[0].detail}")
    return {"graph checks passed": sum(r.status is Status.PASSED for r in results), "compiled variants": compiled_variants()}


def generate(args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    device = ["--device", "cuda"] + (["--emulate"] if args.rehearse else [])
    run = subprocess.run([sys.executable, "-m", "hal.tools.cli", "generate", "--model", str(args.checkpoint), *device,
                          "--prompts-file", str(args.out / "prompts.json"), "--dtype", "bfloat16", "--kv-dtype", "bfloat16",
                          "--page-size", "16", "--max-new-tokens", str(8 if args.rehearse else 48), "--json", *extra],
                         capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise RuntimeError(f"hal generate {' '.join(extra)}: {run.stderr.strip().splitlines()[-1:]}")
    return json.loads(run.stdout)  # type: ignore[no-any-return]


def step_mtp(args: argparse.Namespace) -> dict[str, Any]:
    """The seed's scenario on the device: ``hal generate --speculative mtp`` on a MiMo-V2-Flash
    checkpoint exported on the CPU beforehand, bf16 weights and KV, pages of 16, against greedy:
    equal, or departing only at a near-tie that bf16 rounding explains (README: low precision)."""
    from hal.speculative.mimo import MiMoV2Flash
    from hal.tools.demo import make_prompts, near_tie

    if args.checkpoint is None or not (args.checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"--checkpoint {args.checkpoint}: no exported checkpoint (hal demo --export DIR, on the CPU)")
    model = MiMoV2Flash.from_pretrained(args.checkpoint)
    prompts = make_prompts(4, model.config.vocab_size, 0)
    (args.out / "prompts.json").write_text(json.dumps(prompts))
    greedy = generate(args)
    mtp = generate(args, "--speculative", "mtp", "--num-draft-steps", "3")
    low = MiMoV2Flash.from_pretrained(args.checkpoint, dtype=BF16)
    departures = []
    for i, (a, b) in enumerate(zip(greedy["tokens"], mtp["tokens"])):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is not None:
            tie = near_tie(model, low, prompts[i] + a[:first], a[first], b[first])
            departures.append({"request": i, "token": first, "within": tie.within, "judged": str(tie)})
    if not all(d["within"] for d in departures):
        raise AssertionError(f"MTP departs from greedy beyond bf16 rounding: {departures}")
    return {"accept length": mtp["accept_length"], "identical": not departures, "departures": departures,
            "greedy tokens/s": greedy["tokens_per_second"], "mtp tokens/s": mtp["tokens_per_second"],
            "mtp / greedy": mtp["tokens_per_second"] / greedy["tokens_per_second"]}


def step_figures(args: argparse.Namespace) -> dict[str, Any]:
    """Ratios measured side by side in this run: graph replay vs eager per decode step (batch 1 and 8),
    split-KV vs single pass at batch 1 with 32k keys (4k rehearsed)."""
    from hal.backends.cuda.triton_attention import paged_attention

    be = backend(args)
    figures: dict[str, Any] = {}
    kv_len = 32768 if not args.rehearse else 512
    layer = LayerSpec(0, 16, 1, 192, 128, scaling=192**-0.5) if not args.rehearse else LayerSpec(0, 4, 1, 48, 32, scaling=48**-0.5)
    pool, table = cuda_check._filled(be, layer, [kv_len], 64 if not args.rehearse else 16, BF16)
    md = hal.build_metadata(ForwardMode.DECODE, kv_lens=[kv_len], q_lens=[1], page_table=table.table([0]),
                            out_cache_loc=torch.zeros(1, dtype=torch.int64), pool=pool)
    q = torch.randn(1, layer.num_q_heads, layer.head_dim, device=be.device).to(BF16)
    call = (q, pool.k_buffer(0), pool.v_buffer(0), md.block_table, md.kv_lens, md.cu_q_lens)

    def attend(splits: int | None) -> Callable[[], torch.Tensor]:
        return lambda: paged_attention(*call, scaling=layer.scaling, sliding_window=None, sinks=None, query_rows_hint=1,
                                       num_splits=splits)

    single, split = cuda_check.median_ms(be, attend(1)), cuda_check.median_ms(be, attend(None))
    figures[f"split-KV vs single pass, batch 1, {kv_len} keys (single ms / split ms)"] = round(single / split, 2)
    figures["graph replay vs eager per decode step"] = cuda_check.graph_vs_eager(be, [1, 8], rehearse=args.rehearse)
    return figures


def step_bench(args: argparse.Namespace) -> dict[str, Any]:
    """hal greedy and MTP (S=3) against the plain decoder (contiguous KV cache + SDPA, what a user
    would write without hal), as ``hal bench --plain`` measures them, on the carried checkpoint's
    model in float32 (tokens must equal the plain decoder's): batch 1 and 8, alternating runs,
    the median ratio and its spread."""
    import statistics

    from hal.speculative import GreedyDecoder, MultiLayerEagleWorker
    from hal.speculative.mimo import MiMoV2Flash
    from hal.tools.plain_decoder import PlainDecoder

    be = backend(args)
    model = MiMoV2Flash.from_pretrained(args.checkpoint).to(be.device)
    prompt_len, new_tokens, repeats = (8, 4, 1) if args.rehearse else (64, 32, 3)
    plain = PlainDecoder(model, be.device)
    gen = torch.Generator().manual_seed(0)
    figures: dict[str, Any] = {}
    for batch in (1, 2) if args.rehearse else (1, 8):
        prompts = torch.randint(1, model.config.vocab_size, (batch, prompt_len), generator=gen).tolist()
        sizes: dict[str, Any] = {"max_batch_size": batch, "max_seq_len": prompt_len + new_tokens + 4, "graph_batch_sizes": [batch]}
        engines = {"greedy": GreedyDecoder(model, be, kv_dtype=torch.float32, **sizes),
                   "mtp": MultiLayerEagleWorker(model, be, num_steps=3, kv_dtype=torch.float32, **sizes)}
        for engine in (plain, *engines.values()):
            engine.generate(prompts, 2)  # first calls, compiles and captures stay out of the figures
        ratios: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(repeats):
            for name, engine in engines.items():
                reference = plain.generate(prompts, new_tokens)
                result = engine.generate(prompts, new_tokens)
                if result.tokens != reference.tokens:
                    raise AssertionError(f"hal {name} tokens differ from the plain decoder's at batch {batch}")
                ratios[name].append(result.tokens_per_second / reference.tokens_per_second)
        for name, values in ratios.items():
            figures[f"hal {name} / plain decoder tok/s, batch {batch}, prompt {prompt_len}"] = (
                f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
    return figures


STEPS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "environment": step_environment,
    "correctness": step_correctness,
    "graphs": step_graphs,
    "mtp": step_mtp,
    "figures": step_figures,
    "bench": step_bench,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true", help="on the CPU: Triton interpreter, tiny shapes")
    parser.add_argument("--checkpoint", type=Path, default=None, help="the exported MiMo-V2-Flash checkpoint (step mtp)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    record: dict[str, Any] = {"name": args.step, "ok": True, "figures": {}, "error": None}
    try:
        record["figures"] = STEPS[args.step](args)
    except Exception as exc:  # noqa: BLE001 - the step's result is its record; the next step still runs
        record["ok"], record["error"] = False, f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    record["seconds"] = round(time.perf_counter() - started, 1)
    with open(args.out / "results.jsonl", "a") as results:
        results.write(json.dumps(record, default=str) + "\n")
    print(json.dumps(record, default=str))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
