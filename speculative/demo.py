"""``hal demo``: the tiny MiMo-V2-style model decoded with and without MTP speculative decoding.

Builds the model, distils its MTP blocks (cached), generates a batch of prompts with plain greedy
decoding and with the multi-layer EAGLE worker, checks the outputs are identical token for token,
and prints accept length, tokens/s and the speedup.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TextIO

import torch

import hal
from hal.errors import UnsupportedConfigError
from speculative.distill import DistillConfig, distill
from speculative.model import TinyConfig, TinyMiMo
from speculative.worker import GreedyDecoder, MultiLayerEagleWorker

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="hal device string (default: cpu)")
    parser.add_argument("--emulate", action="store_true", help="run the backend on its CPU emulator (e.g. npu)")
    parser.add_argument("--num-steps", type=int, default=3, help="MTP draft steps S (default: 3)")
    parser.add_argument("--train-steps", type=int, default=DistillConfig().steps, help="MTP distillation steps")
    parser.add_argument(
        "--train-sequences", type=int, default=DistillConfig().num_sequences, help="greedy continuations to distil on"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--batch-size", type=int, default=4, help="number of prompts")
    parser.add_argument("--page-size", type=int, default=128, help="KV page size (128 is legal on every backend)")
    parser.add_argument(
        "--kv-dtype",
        choices=["auto", *sorted(KV_DTYPES)],
        default="auto",
        help="KV cache dtype; auto = float32, or bfloat16 where the backend's kernel takes no float32",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="model and prompt seed")
    parser.add_argument("--no-cache", action="store_true", help="retrain the MTP blocks even if cached")


def make_prompts(batch_size: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of different lengths (5, 8, 11, ...), deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(1, vocab_size, (5 + 3 * i,), generator=gen).tolist() for i in range(batch_size)]


def _progress_printer(stream: TextIO) -> Callable[[str, int, int, float | None], None]:
    """A one-line text progress bar per phase, redrawn only when the bar grows."""
    width = 30
    drawn: dict[str, int] = {}

    def show(phase: str, done: int, total: int, loss: float | None) -> None:
        filled = width * done // max(total, 1)
        if drawn.get(phase) == filled and done != total:
            return
        drawn[phase] = filled
        label = "generating training data" if phase == "data" else "distilling MTP blocks"
        tail = f" loss {loss:.3f}" if loss is not None else ""
        stream.write(f"\r{label:<26} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}{tail}")
        if done == total:
            stream.write("\n")
        stream.flush()

    return show


def build_engines(
    model: TinyMiMo, device: str, num_steps: int, kv_dtype: str, **engine_args: Any
) -> tuple[GreedyDecoder, MultiLayerEagleWorker, torch.dtype]:
    """Both decoders on ``device``. ``kv_dtype="auto"`` tries float32 and falls back to bfloat16
    when the backend's kernel rejects float32 (it does so while capturing the first graph)."""
    candidates = [torch.float32, torch.bfloat16] if kv_dtype == "auto" else [KV_DTYPES[kv_dtype]]
    for i, dtype in enumerate(candidates):
        try:
            plain = GreedyDecoder(model, device, kv_dtype=dtype, **engine_args)
            spec = MultiLayerEagleWorker(model, device, num_steps=num_steps, kv_dtype=dtype, **engine_args)
            return plain, spec, dtype
        except UnsupportedConfigError:
            if i + 1 == len(candidates):
                raise
    raise AssertionError("unreachable")


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the demo; returns 0 when speculative output equals plain greedy output, 1 otherwise."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    hal.get_backend(args.device, emulate=args.emulate)  # an unknown or unavailable device fails before training
    model = TinyMiMo(TinyConfig(seed=args.seed, num_mtp_layers=args.num_steps))
    report = distill(
        model,
        DistillConfig(steps=args.train_steps, num_sequences=args.train_sequences),
        use_cache=not args.no_cache,
        progress=_progress_printer(out),
    )
    where = f"loaded from {report.cache_path}" if report.from_cache else f"trained in {report.seconds:.1f}s"
    print(f"MTP blocks: {where}", file=out)
    plain, spec, kv_dtype = build_engines(
        model,
        args.device,
        args.num_steps,
        args.kv_dtype,
        emulate=args.emulate,
        page_size=args.page_size,
        max_batch_size=args.batch_size,
        max_seq_len=16 + 3 * args.batch_size + args.max_new_tokens + args.num_steps + 1,
    )
    prompts = make_prompts(args.batch_size, model.config.vocab_size, args.seed)
    # One untimed warm-up each, so graph capture and first-call costs stay out of the figures.
    plain.generate(prompts[:1], 2)
    spec.generate(prompts[:1], 2)
    base = plain.generate(prompts, args.max_new_tokens)
    fast = spec.generate(prompts, args.max_new_tokens)
    identical = base.tokens == fast.tokens
    speedup = fast.tokens_per_second / base.tokens_per_second
    print(f"backend: {spec.backend_name} (device {spec.device}{', emulated' if args.emulate else ''})", file=out)
    print(f"KV cache: {str(kv_dtype).replace('torch.', '')}, pages of {args.page_size} tokens", file=out)
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
