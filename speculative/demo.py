"""``hal demo``: the tiny MiMo-V2-style model decoded with and without MTP speculative decoding.

Builds the model, distils its MTP blocks (cached), generates a batch of prompts with plain greedy
decoding and with the multi-layer EAGLE worker, checks the outputs are identical token for token,
and prints accept length, tokens/s and the speedup.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

import torch

from speculative.distill import DistillConfig, distill
from speculative.model import TinyConfig, TinyMiMo
from speculative.worker import GreedyDecoder, MultiLayerEagleWorker

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="hal device string (default: cpu)")
    parser.add_argument("--emulate", action="store_true", help="run the backend on its CPU emulator (e.g. npu)")
    parser.add_argument("--num-steps", type=int, default=3, help="MTP draft steps S (default: 3)")
    parser.add_argument("--train-steps", type=int, default=DistillConfig().steps, help="MTP distillation steps")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--batch-size", type=int, default=4, help="number of prompts")
    parser.add_argument("--page-size", type=int, default=128, help="KV page size (128 is legal on every backend)")
    parser.add_argument(
        "--kv-dtype", choices=sorted(KV_DTYPES), default="float32", help="KV cache dtype (bfloat16 for npu)"
    )
    parser.add_argument("--seed", type=int, default=0, help="model and prompt seed")
    parser.add_argument("--no-cache", action="store_true", help="retrain the MTP blocks even if cached")


def make_prompts(batch_size: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of different lengths (5, 8, 11, ...), deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(1, vocab_size, (5 + 3 * i,), generator=gen).tolist() for i in range(batch_size)]


def _progress_printer(stream: TextIO):  # type: ignore[no-untyped-def]
    def show(phase: str, done: int, total: int, loss: float | None) -> None:
        width = 30
        filled = width * done // max(total, 1)
        label = "generating training data" if phase == "data" else "distilling MTP blocks"
        tail = f" loss {loss:.3f}" if loss is not None else ""
        stream.write(f"\r{label:<26} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}{tail}")
        if done == total:
            stream.write("\n")
        stream.flush()

    return show


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the demo; returns 0 when speculative output equals plain greedy output, 1 otherwise."""
    model = TinyMiMo(TinyConfig(seed=args.seed, num_mtp_layers=args.num_steps))
    report = distill(
        model,
        DistillConfig(steps=args.train_steps),
        use_cache=not args.no_cache,
        progress=_progress_printer(out),
    )
    where = f"loaded from {report.cache_path}" if report.from_cache else f"trained in {report.seconds:.1f}s"
    print(f"MTP blocks: {where}", file=out)
    engine_args = dict(
        emulate=args.emulate,
        page_size=args.page_size,
        kv_dtype=KV_DTYPES[args.kv_dtype],
        max_batch_size=args.batch_size,
        max_seq_len=16 + 3 * args.batch_size + args.max_new_tokens + args.num_steps + 1,
    )
    plain = GreedyDecoder(model, args.device, **engine_args)
    spec = MultiLayerEagleWorker(model, args.device, num_steps=args.num_steps, **engine_args)
    prompts = make_prompts(args.batch_size, model.config.vocab_size, args.seed)
    # One untimed warm-up each, so graph capture and first-call costs stay out of the figures.
    plain.generate(prompts[:1], 2)
    spec.generate(prompts[:1], 2)
    base = plain.generate(prompts, args.max_new_tokens)
    fast = spec.generate(prompts, args.max_new_tokens)
    identical = base.tokens == fast.tokens
    speedup = fast.tokens_per_second / base.tokens_per_second
    print(f"backend: {spec.backend_name} (device {spec.device}{', emulated' if args.emulate else ''})", file=out)
    print(f"requests: {len(prompts)}, prompt lengths {[len(p) for p in prompts]}, {args.max_new_tokens} new tokens each", file=out)
    print(f"plain greedy:     {base.tokens_per_second:8.1f} tokens/s  ({base.target_forwards} target forwards)", file=out)
    print(
        f"MTP (S={args.num_steps}):        {fast.tokens_per_second:8.1f} tokens/s  ({fast.target_forwards} target forwards)",
        file=out,
    )
    print(f"accept length:    {fast.mean_accept_length:.2f} of {args.num_steps + 1}", file=out)
    print(f"speedup:          {speedup:.2f}x", file=out)
    print(f"outputs identical: {'yes' if identical else 'NO'}", file=out)
    if not identical:
        for i, (a, b) in enumerate(zip(base.tokens, fast.tokens)):
            if a != b:
                first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"  request {i} differs from token {first}", file=out)
        return 1
    return 0
