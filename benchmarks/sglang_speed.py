"""hal's attention backend against SGLang's own ``torch_native`` inside ``sglang.Engine``, one run.

    PYTHONPATH=tests/integrations/sglang/site SGLANG_USE_CPU_ENGINE=1 \\
        python benchmarks/sglang_speed.py [--prompt-lens 128 900] [--dtypes float32 float16] [--repeats 5]
    PYTHONPATH=tests/integrations/sglang/site SGLANG_USE_CPU_ENGINE=1 SGLANG_PLATFORM=hal \\
        python benchmarks/sglang_speed.py --mtp [--prompt-lens 1024] [--batch 4] [--new-tokens 64] [--repeats 5]
    PYTHONPATH=tests/integrations/sglang/site python benchmarks/sglang_speed.py --attention-step [--kv-lens 150 940] [--threads 1 2]
    PYTHONPATH=tests/integrations/sglang/site SGLANG_USE_CPU_ENGINE=1 SGLANG_PLATFORM=hal \\
        python benchmarks/sglang_speed.py --eagle [--prompt-lens 64] [--batch 4] [--new-tokens 32] [--repeats 5]

Both engines serve the same random Llama (saved by transformers) side by side; each timed sample is
one ``generate`` of ``--batch`` prompts with ``--new-tokens`` greedy tokens, the two backends
alternating so that machine load hits both alike (an idle engine sleeps instead of polling). The
table gives the median of the paired ratios (hal tokens/s over torch_native tokens/s), their
lowest and highest, and how many of the requests
got the same greedy tokens from both. Exits 1 if an fp32 row's tokens differ (in fp16 the two
kernels round differently: hal accumulates in fp32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import hal
from hal.integrations.sglang import mimo_rope_override
from hal.tools.testing import save_published_copy, save_random_llama


def make_mimo_mtp(directory: Path, steps: int) -> Path:
    """hal's tiny MiMo-V2-Flash with ``steps`` distilled MTP layers, in SGLang's published config form."""
    from hal.speculative.distill import distill
    from hal.speculative.model import TinyConfig, TinyMiMo

    tiny = TinyMiMo(TinyConfig(num_mtp_layers=steps))
    distill(tiny, hal.get_backend("cpu"))
    return save_published_copy(tiny.save_pretrained(directory / "transformers"), directory / "published")


def bench_mtp(args: argparse.Namespace) -> int:
    """Multi-layer EAGLE against plain decoding inside sglang.Engine, all through hal, without a
    radix cache (each timed sample repeats the prompts; with no cache to hit, the prefill's draft
    extend runs over each prompt's window tail: the patch in ``patches/``). A third engine runs
    that draft extend over the whole prompt as upstream does (the test site's
    ``HAL_SGLANG_WHOLE_PREFILL_DRAFT_EXTEND``): the before and after of that patch, side by side."""
    import json
    import os

    import sglang

    from hal.tools.demo import make_prompts

    steps = 3
    model = make_mimo_mtp(Path(tempfile.mkdtemp()), steps)
    config = json.loads((model / "config.json").read_text())
    spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=steps, speculative_eagle_topk=1,
                speculative_num_draft_tokens=steps + 1, speculative_draft_model_path=str(model))  # fmt: skip

    def start(name: str) -> Any:
        os.environ["HAL_SGLANG_WHOLE_PREFILL_DRAFT_EXTEND"] = "1" if name == "mtp-whole" else "0"  # read as its processes start
        return sglang.Engine(
            model_path=str(model), device="cpu", attention_backend="hal", dtype="float32", skip_tokenizer_init=True,
            disable_cuda_graph=True, random_seed=0, max_total_tokens=8192, sleep_on_idle=True, disable_radix_cache=True,
            json_model_override_args=mimo_rope_override(model), **(spec if name != "plain" else {}),
        )

    # The demo's short prompts (5, 8, 11, ... tokens), or random ones of each --prompt-lens length.
    gen = torch.Generator().manual_seed(1)
    batches = [("demo", make_prompts(args.batch, config["vocab_size"], 0))] if args.prompt_lens is None else [
        (str(n), torch.randint(1, config["vocab_size"], (args.batch, n), generator=gen).tolist()) for n in args.prompt_lens]
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    names = ("mtp", "mtp-whole", "plain")
    # The accept length is read while the speculative engine is the only one: SGLang's front end
    # computes it from process-wide settings, which the second engine replaces.
    engines = {"mtp": start("mtp")}
    rows, all_same = [], True
    try:
        accepts = []
        for _, prompts in batches:
            out = engines["mtp"].generate(input_ids=prompts, sampling_params=params)
            verifies = sum(o["meta_info"].get("spec_verify_ct", 0) for o in out)  # none with one new token: the prefill alone
            accepts.append((sum(len(o["output_ids"]) - 1 for o in out) / verifies if verifies else None, [o["output_ids"] for o in out]))
        engines["mtp-whole"], engines["plain"] = start("mtp-whole"), start("plain")
        for (label, prompts), (accept, mtp_tokens) in zip(batches, accepts):
            same = all(mtp_tokens == [o["output_ids"] for o in engines[name].generate(input_ids=prompts, sampling_params=params)]
                       for name in ("mtp-whole", "plain"))
            all_same &= same
            rates: dict[str, list[float]] = {name: [] for name in names}
            for i in range(args.repeats):
                for name in names[i % 3:] + names[: i % 3]:  # each engine first in turn
                    begin = time.perf_counter()
                    engines[name].generate(input_ids=prompts, sampling_params=params)
                    rates[name].append(args.batch * args.new_tokens / (time.perf_counter() - begin))

            def ratio(a: str, b: str) -> str:
                ratios = [x / y for x, y in zip(rates[a], rates[b])]
                return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"

            rows.append(f"| {label} | {' | '.join(f'{statistics.median(rates[n]):.1f}' for n in names)} | {ratio('mtp', 'plain')} "
                        f"| {ratio('mtp-whole', 'plain')} | {ratio('mtp', 'mtp-whole')} | {'-' if accept is None else f'{accept:.2f}'} of {steps + 1} "
                        f"| {'yes' if same else 'no'} |")
    finally:
        os.environ.pop("HAL_SGLANG_WHOLE_PREFILL_DRAFT_EXTEND", None)
        for engine in engines.values():
            engine.shutdown()
    print(f"torch threads {torch.get_num_threads()}, batch {args.batch}, {args.new_tokens} new tokens, {args.repeats} rounds of "
          "the three engines, each first in turn; ratios: median (lowest-highest)")
    print("| prompt | MTP tok/s | MTP, whole-prompt draft extend, tok/s | plain tok/s | MTP / plain | MTP whole-prompt / plain "
          "| MTP / MTP whole-prompt | accept length | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0 if all_same else 1


def bench_eagle(args: argparse.Namespace) -> int:
    """EAGLE with an EAGLE draft model, topk 1, 2 and 4, against plain decoding inside sglang.Engine,
    all through hal: a random Llama and a draft distilled from it (``save_distilled_eagle_draft``)."""
    import sglang

    from hal.tools.testing import save_distilled_eagle_draft

    steps = 3
    root = Path(tempfile.mkdtemp())
    # test_eagle_engine.py's pair: on a larger random Llama a one-layer draft distilled this briefly is never accepted.
    target = save_random_llama(root / "target", initializer_range=0.02)
    draft = save_distilled_eagle_draft(target, root / "draft")
    topks = (1, 2, 4)

    def start(topk: int | None) -> Any:
        spec = {} if topk is None else dict(
            speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft), speculative_num_steps=steps,
            speculative_eagle_topk=topk, speculative_num_draft_tokens=min(1 + steps * topk, 8) if topk > 1 else steps + 1)
        return sglang.Engine(model_path=str(target), device="cpu", attention_backend="hal", dtype="float32", skip_tokenizer_init=True,
                             disable_cuda_graph=True, random_seed=0, max_total_tokens=8192, sleep_on_idle=True, **spec)

    gen = torch.Generator().manual_seed(1)
    length = (args.prompt_lens or [64])[0]
    prompts = torch.randint(1, 256, (args.batch, length), generator=gen).tolist()
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    engines: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    accepts: dict[str, float] = {}
    try:
        # Each accept length is read while its engine is the newest (SGLang's front end reads process-wide settings).
        for topk in topks:
            name = f"topk {topk}"
            engines[name] = start(topk)
            out = engines[name].generate(input_ids=prompts, sampling_params=params)
            tokens[name] = [o["output_ids"] for o in out]
            accepts[name] = sum(len(o["output_ids"]) - 1 for o in out) / sum(o["meta_info"]["spec_verify_ct"] for o in out)
        engines["plain"] = start(None)
        tokens["plain"] = [o["output_ids"] for o in engines["plain"].generate(input_ids=prompts, sampling_params=params)]
        rates: dict[str, list[float]] = {name: [] for name in engines}
        names = list(engines)
        for i in range(args.repeats):
            for name in names[i % len(names):] + names[: i % len(names)]:  # a rotating order
                begin = time.perf_counter()
                engines[name].generate(input_ids=prompts, sampling_params=params)
                rates[name].append(args.batch * args.new_tokens / (time.perf_counter() - begin))
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(f"torch threads {torch.get_num_threads()}, batch {args.batch}, prompts of {length} tokens, {args.new_tokens} new tokens, "
          f"{args.repeats} rotating rounds, {steps} draft steps")
    print("| EAGLE | tok/s | plain tok/s | EAGLE / plain (median) | spread | accept length | same tokens as plain |")
    print("|---|---|---|---|---|---|---|")
    all_same = True
    for topk in topks:
        name = f"topk {topk}"
        ratios = [e / p for e, p in zip(rates[name], rates["plain"])]
        same = tokens[name] == tokens["plain"]
        all_same &= same
        print(f"| {name} | {statistics.median(rates[name]):.1f} | {statistics.median(rates['plain']):.1f} | {statistics.median(ratios):.2f} "
              f"| {min(ratios):.2f}-{max(ratios):.2f} | {accepts[name]:.2f} | {'yes' if same else 'no'} |")
    return 0 if all_same else 1


def bench_attention_step(args: argparse.Namespace) -> int:
    """The attention backends alone, outside the engine: one decode step of hal's backend against
    SGLang's ``torch_native`` on the same pool, request table and ForwardBatch (the step's metadata
    from SGLang's request table, then the layers), as SGLang's CPU path lays out a batch: pages of
    one token, each request's prompt on consecutive slots, each decode step's slots handed out
    across the batch. Same shapes as the engine rows' Llama."""
    import types

    import hal
    from hal.integrations.sglang.attention import HalAttnBackend
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    q_heads, kv_heads, head_dim, layers, prompt = 8, 2, 32, 4, 128
    batch, gen = args.batch, torch.Generator().manual_seed(0)
    print(f"batch {batch}, {layers} layers, {q_heads} q and {kv_heads} kv heads of {head_dim}, prompts of {prompt} tokens, "
          f"medians of {args.repeats} alternating blocks of 100 steps")
    print("| threads | kv length | hal ms/step | torch_native ms/step | hal / torch_native time (median) | spread |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for kv_len in args.kv_lens:
        pool = MHATokenToKVPool(size=batch * kv_len + 1, page_size=1, dtype=torch.float32, head_num=kv_heads, head_dim=head_dim,
                                layer_num=layers, device="cpu", enable_memory_saver=False)
        for i in range(layers):
            pool.k_buffer[i].normal_(generator=gen), pool.v_buffer[i].normal_(generator=gen)
        req_to_token = torch.zeros((batch, kv_len), dtype=torch.int32)
        for r in range(batch):
            req_to_token[r, :prompt] = 1 + r * prompt + torch.arange(prompt)
            req_to_token[r, prompt:] = 1 + batch * prompt + torch.arange(kv_len - prompt) * batch + r
        runner = types.SimpleNamespace(device="cpu", req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
                                       token_to_kv_pool=pool, model_config=types.SimpleNamespace(context_len=kv_len))
        backends = {"hal": HalAttnBackend(runner, hal.get_backend("cpu")), "torch_native": TorchNativeAttnBackend(runner)}
        radix = [RadixAttention(q_heads, head_dim, head_dim**-0.5, kv_heads, i) for i in range(layers)]
        seq_lens = torch.full((batch,), kv_len)
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=batch, input_ids=torch.zeros(batch, dtype=torch.long),
                          req_pool_indices=torch.arange(batch), seq_lens=seq_lens, out_cache_loc=req_to_token[:, -1].long(),
                          seq_lens_sum=batch * kv_len)
        fb.seq_lens_cpu, fb.token_to_kv_pool, fb.req_to_token_pool = seq_lens, pool, runner.req_to_token_pool
        q = torch.randn(batch, q_heads * head_dim, generator=gen)
        k, v = torch.randn(batch, kv_heads, head_dim, generator=gen), torch.randn(batch, kv_heads, head_dim, generator=gen)

        def step(backend: Any) -> torch.Tensor:
            backend.init_forward_metadata(fb)
            return torch.stack([backend.forward_decode(q, k, v, layer, fb).reshape(batch, -1) for layer in radix])

        difference = float((step(backends["hal"]) - step(backends["torch_native"])).abs().max())
        worst = max(worst, difference)
        for threads in args.threads:
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {name: [] for name in backends}
            for i in range(args.repeats):
                for name in backends if i % 2 == 0 else reversed(list(backends)):
                    begin = time.perf_counter()
                    for _ in range(100):
                        step(backends[name])
                    times[name].append((time.perf_counter() - begin) * 10)  # ms per step
            ratios = [h / n for h, n in zip(times["hal"], times["torch_native"])]
            print(f"| {threads} | {kv_len} | {statistics.median(times['hal']):.2f} | {statistics.median(times['torch_native']):.2f} "
                  f"| {statistics.median(ratios):.2f} | {min(ratios):.2f}-{max(ratios):.2f} |", flush=True)
    print(f"largest output difference between the backends: {worst:.2e}")
    return 0 if worst < 1e-4 else 1


def main(argv: list[str] | None = None) -> int:
    import sglang

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None,
                        help="prompt lengths (default 128 900; with --mtp, the demo's short prompts)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mtp", action="store_true", help="multi-layer EAGLE vs plain decoding on hal's tiny MiMo-V2-Flash")
    parser.add_argument("--eagle", action="store_true",
                        help="EAGLE with a distilled draft model, topk 1, 2 and 4, vs plain decoding on a random Llama")
    parser.add_argument("--attention-step", action="store_true",
                        help="hal's attention backend vs torch_native's on one decode step, outside the engine")
    parser.add_argument("--kv-lens", type=int, nargs="+", default=[150, 940], help="with --attention-step: the steps' kv lengths")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="with --attention-step: torch threads")
    args = parser.parse_args(argv)
    if args.attention_step:
        return bench_attention_step(args)
    if args.mtp:
        return bench_mtp(args)
    if args.eagle:
        return bench_eagle(args)
    model = Path(tempfile.mkdtemp()) / "llama"
    save_random_llama(model, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      max_position_embeddings=2048)
    gen = torch.Generator().manual_seed(1)
    print(f"torch threads {torch.get_num_threads()}, batch {args.batch}, {args.new_tokens} new tokens, {args.repeats} alternating pairs")
    print("| dtype | prompt | hal tok/s | torch_native tok/s | hal / torch_native (median) | spread | same tokens |")
    print("|---|---|---|---|---|---|---|")
    same = True
    for dtype in args.dtypes:
        engines = {
            name: sglang.Engine(
                model_path=str(model), device="cpu", attention_backend=name, dtype=dtype, skip_tokenizer_init=True,
                disable_cuda_graph=True, random_seed=0, max_total_tokens=16384, disable_radix_cache=True, sleep_on_idle=True,
            )
            for name in ("hal", "torch_native")
        }
        try:
            for length in args.prompt_lens or [128, 900]:
                prompts = torch.randint(3, 1000, (args.batch, length), generator=gen).tolist()
                params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
                outputs: dict[str, list[list[int]]] = {}
                for name, engine in engines.items():  # warm-up
                    outputs[name] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
                equal = sum(a == b for a, b in zip(outputs["hal"], outputs["torch_native"]))
                same &= dtype != "float32" or equal == args.batch
                rates: dict[str, list[float]] = {"hal": [], "torch_native": []}
                for i in range(args.repeats):
                    order = ("hal", "torch_native") if i % 2 == 0 else ("torch_native", "hal")
                    for name in order:
                        start = time.perf_counter()
                        engines[name].generate(input_ids=prompts, sampling_params=params)
                        rates[name].append(args.batch * args.new_tokens / (time.perf_counter() - start))
                ratios = [h / n for h, n in zip(rates["hal"], rates["torch_native"])]
                print(
                    f"| {dtype} | {length} | {statistics.median(rates['hal']):.1f} | {statistics.median(rates['torch_native']):.1f} "
                    f"| {statistics.median(ratios):.2f} | {min(ratios):.2f}-{max(ratios):.2f} | {equal}/{args.batch} |",
                    flush=True,
                )
        finally:
            for engine in engines.values():
                engine.shutdown()
    if not same:
        print("hal's fp32 tokens differ from torch_native's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
