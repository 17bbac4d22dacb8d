"""``hal demo``: the tiny MiMo-V2-style model decoded with and without MTP speculative decoding.

Builds the model, distils its MTP blocks (cached), generates a batch of prompts with plain greedy
decoding and with the multi-layer EAGLE worker, checks the outputs are identical token for token,
and prints accept length, tokens/s and the speedup.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from typing import Any, TextIO, TypeVar

import attrs
import torch

from hal.errors import UnsupportedConfigError
from hal.speculative.distill import DistillConfig, DistillReport, distill
from hal.speculative.mimo import MiMoV2Flash
from hal.speculative.model import EngineModel, TinyConfig, TinyMiMo
from hal.speculative import GreedyDecoder, MultiLayerEagleWorker
from hal.tools.cli import backend_from_args

T = TypeVar("T")
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_prompts(batch_size: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of different lengths (5, 8, 11, ...), deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(1, vocab_size, (5 + 3 * i,), generator=gen).tolist() for i in range(batch_size)]


PHASE_LABELS = {"data": "generating training data", "train": "distilling MTP blocks"}


def progress_printer(stream: TextIO) -> Callable[[str, int, int, float | None], None]:
    """A one-line text progress bar per phase, redrawn only when the bar grows. On a stream that
    is not a terminal (a log file, a pipe) it writes one line per phase, when the phase ends."""
    width = 30
    drawn: dict[str, int] = {}
    terminal = bool(getattr(stream, "isatty", lambda: False)())

    def show(phase: str, done: int, total: int, loss: float | None) -> None:
        if not terminal and done != total:
            return
        filled = width * done // max(total, 1)
        if drawn.get(phase) == filled and done != total:
            return
        drawn[phase] = filled
        label = PHASE_LABELS.get(phase, phase)
        tail = f" loss {loss:.3f}" if loss is not None else ""
        stream.write(f"{chr(13) if terminal else ''}{label:<26} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}{tail}")
        if done == total:
            stream.write("\n")
        stream.flush()

    return show


def with_kv_dtype(kv_dtype: str, build: Callable[[torch.dtype], T]) -> tuple[T, torch.dtype]:
    """``build(dtype)`` for the KV-cache dtype named ``kv_dtype``; ``"auto"`` tries float32 and falls
    back to bfloat16 when the backend's kernel rejects float32 (it does so capturing the first graph)."""
    candidates = [torch.float32, torch.bfloat16] if kv_dtype == "auto" else [KV_DTYPES[kv_dtype]]
    for i, dtype in enumerate(candidates):
        try:
            return build(dtype), dtype
        except UnsupportedConfigError:
            if i + 1 == len(candidates):
                raise
    raise AssertionError("unreachable")


def build_engines(
    model: EngineModel, device: str, num_steps: int, kv_dtype: str, **engine_args: Any
) -> tuple[GreedyDecoder, MultiLayerEagleWorker, torch.dtype]:
    """Both decoders on ``device``, with the KV dtype ``with_kv_dtype`` picks."""
    (plain, spec), dtype = with_kv_dtype(
        kv_dtype,
        lambda dt: (
            GreedyDecoder(model, device, kv_dtype=dt, **engine_args),
            MultiLayerEagleWorker(model, device, num_steps=num_steps, kv_dtype=dt, **engine_args),
        ),
    )
    return plain, spec, dtype


@attrs.frozen
class DemoSetup:
    """The distilled model and both decoders, as ``hal demo`` and the benchmarks build them."""

    model: MiMoV2Flash  # loaded from the demo's checkpoint
    report: DistillReport
    plain: GreedyDecoder
    spec: MultiLayerEagleWorker
    kv_dtype: torch.dtype


def setup(
    args: argparse.Namespace,
    max_batch_size: int,
    progress: Callable[[str, int, int, float | None], None] | None = None,
) -> DemoSetup:
    """From ``hal demo``'s options: threads, device check, the model with distilled MTP blocks, and
    both decoders sized for ``max_batch_size`` prompts of ``args.max_new_tokens`` new tokens."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    backend_from_args(args)  # an unknown or unavailable device fails before training
    tiny = TinyMiMo(TinyConfig(seed=args.seed, num_mtp_layers=args.num_steps))
    overrides = {k: v for k, v in (("steps", args.train_steps), ("num_sequences", args.train_sequences)) if v is not None}
    report = distill(tiny, attrs.evolve(DistillConfig(), **overrides), use_cache=not args.no_cache, progress=progress)
    # The demo runs what it exports: a MiMo-V2-Flash checkpoint (transformers loads it too).
    with tempfile.TemporaryDirectory() as scratch:
        directory = tiny.save_pretrained(args.export or scratch)
        model = MiMoV2Flash.from_pretrained(directory)
    plain, spec, kv_dtype = build_engines(
        model,
        args.device,
        args.num_steps,
        args.kv_dtype,
        emulate=args.emulate,
        page_size=args.page_size,
        max_batch_size=max_batch_size,
        max_seq_len=16 + 3 * max_batch_size + args.max_new_tokens + args.num_steps + 1,
    )
    return DemoSetup(model, report, plain, spec, kv_dtype)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the demo; returns 0 when speculative output equals plain greedy output, 1 otherwise."""
    demo = setup(args, args.batch_size, progress=progress_printer(out))
    model, report, plain, spec, kv_dtype = demo.model, demo.report, demo.plain, demo.spec, demo.kv_dtype
    where = f"loaded from {report.cache_path}" if report.from_cache else f"trained in {report.seconds:.1f}s"
    print(f"MTP blocks: {where}", file=out)
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
