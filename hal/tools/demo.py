"""``hal demo``: the tiny MiMo-V2-style model decoded with and without MTP speculative decoding.

Builds the model, distils its MTP blocks (cached), generates a batch of prompts with plain greedy
decoding and with the multi-layer EAGLE worker, checks the outputs are identical token for token,
and prints accept length, tokens/s and the speedup.
"""

from __future__ import annotations

import argparse
import os
import select
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch

import hal
from hal.errors import SpecError
from hal.protocols import Backend
from hal.speculative.distill import DenseAttend, DistillConfig, DistillReport, distill
from hal.speculative.mimo import MiMoV2Flash
from hal.speculative.contract import EngineModel
from hal.speculative.model import TinyConfig, TinyMiMo
from hal.speculative import GreedyDecoder, MultiLayerEagleWorker
from hal.tools.cli import backend_from_args, check_kv_dtype_option, dtype_option


def make_prompts(batch_size: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts of different lengths (5, 8, 11, ...), deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(1, vocab_size, (5 + 3 * i,), generator=gen).tolist() for i in range(batch_size)]


PHASE_LABELS = {"data": "generating training data", "train": "distilling MTP blocks", "decode": "decoding (plain, then MTP)"}


def reader_left(stream: TextIO) -> bool:
    """Whether ``stream`` is a pipe whose reader has closed it: ``poll`` reports an error on the
    write end at once, where a write would only fail at the next line, minutes of work later."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file behind it (a StringIO), or closed
        return False


def progress_printer(stream: TextIO) -> Callable[[str, int, int, float | None], None]:
    """A one-line text progress bar per phase, redrawn only when the bar grows. On a stream that
    is not a terminal (a log file, a pipe) it writes a line when the phase starts and at each
    quarter of it, so a log shows what a long run is doing without a line per step."""
    width = 30
    drawn: dict[str, int] = {}
    terminal = bool(getattr(stream, "isatty", lambda: False)())

    def show(phase: str, done: int, total: int, loss: float | None) -> None:
        if reader_left(stream):  # hal demo | head -1: stop working, not only writing, once the reader is gone
            raise BrokenPipeError(f"the reader of {getattr(stream, 'name', 'the output')} has gone")
        total = max(total, 1)
        mark = (width if terminal else 4) * done // total  # what a line shows: bar cells, or quarters
        if drawn.get(phase) == mark and done != total:
            return
        drawn[phase] = mark
        filled = width * done // total
        label = PHASE_LABELS.get(phase, phase)
        tail = f" loss {loss:.3f}" if loss is not None else ""
        line = f"{label:<26} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}{tail}"
        if terminal:  # one line redrawn in place, ended when the phase is
            stream.write(f"\r{line}" + ("\n" if done == total else ""))
        else:
            stream.write(f"{line}\n")
        stream.flush()

    return show


def check_export_directory(directory: Path) -> None:
    """``--export DIR`` must name a new or empty directory that can be written: an existing
    checkpoint is not overwritten, and an unwritable target is refused before any work (the
    directory is made now)."""
    if directory.exists() and not directory.is_dir():
        raise SpecError(f"--export {directory}: exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()):
        raise SpecError(f"--export {directory}: the directory is not empty (give a new or empty one)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".hal-write-check"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise SpecError(f"--export {directory}: cannot be written ({exc.strerror or exc})") from exc


def build_engines(
    model: EngineModel, backend: Backend, num_steps: int, kv_dtype: torch.dtype | None, **engine_args: Any
) -> tuple[GreedyDecoder, MultiLayerEagleWorker]:
    """Both decoders on ``backend``; ``kv_dtype`` None lets the backend choose for the model's layers."""
    plain = GreedyDecoder(model, backend, kv_dtype=kv_dtype, **engine_args)
    return plain, MultiLayerEagleWorker(model, backend, num_steps=num_steps, kv_dtype=kv_dtype, **engine_args)


@attrs.frozen
class DemoSetup:
    """The distilled model and both decoders, as ``hal demo`` and the benchmarks build them."""

    model: MiMoV2Flash  # loaded from the demo's checkpoint, in --dtype
    float32_model: MiMoV2Flash  # the same checkpoint in float32: the judge of low-precision runs
    report: DistillReport
    plain: GreedyDecoder
    spec: MultiLayerEagleWorker


def setup(
    args: argparse.Namespace,
    max_batch_size: int,
    progress: Callable[[str, int, int, float | None], None] | None = None,
) -> DemoSetup:
    """From ``hal demo``'s options: threads, device check, the model with distilled MTP blocks, and
    both decoders sized for ``max_batch_size`` prompts of ``args.max_new_tokens`` new tokens."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    backend = backend_from_args(args)  # an unknown or unavailable device fails before training
    if args.export is not None:
        check_export_directory(args.export)
    tiny = TinyMiMo(TinyConfig(seed=args.seed, num_mtp_layers=args.num_steps))
    check_kv_dtype_option(backend, tiny.spec.target_layers + tiny.spec.draft_layers, args)  # before training
    overrides = {k: v for k, v in (("steps", args.train_steps), ("num_sequences", args.train_sequences)) if v is not None}
    # The training data is decoded on the CPU backend, whatever the demo then runs on.
    report = distill(tiny, hal.get_backend("cpu"), attrs.evolve(DistillConfig(), **overrides), use_cache=not args.no_cache,
                     progress=progress)
    # The demo runs what it exports: a MiMo-V2-Flash checkpoint (transformers loads it too).
    with tempfile.TemporaryDirectory() as scratch:
        directory = tiny.save_pretrained(args.export or scratch)
        if args.export is not None:
            print(f"checkpoint written to {directory} (config.json, model.safetensors)", file=sys.stderr)
        dtype = dtype_option(args.dtype) or backend.preferred_dtype
        model = MiMoV2Flash.from_pretrained(directory, dtype=dtype)
        float32_model = model if dtype == torch.float32 else MiMoV2Flash.from_pretrained(directory)
    plain, spec = build_engines(
        model,
        backend,
        args.num_steps,
        dtype_option(args.kv_dtype),
        page_size=args.page_size,
        max_batch_size=max_batch_size,
        max_seq_len=16 + 3 * max_batch_size + args.max_new_tokens + args.num_steps + 1,
    )
    return DemoSetup(model, float32_model, report, plain, spec)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the demo; returns 0 when speculative output equals plain greedy output (in float32) or
    departs from it only at near-ties that the dtype's rounding explains (bf16, fp16), 1 otherwise."""
    progress = progress_printer(out)
    demo = setup(args, args.batch_size, progress=progress)
    model, report, plain, spec = demo.model, demo.report, demo.plain, demo.spec
    pool = spec.target_pool.spec
    where = f"loaded from {report.cache_path}" if report.from_cache else f"trained in {report.seconds:.1f}s"
    print(f"MTP blocks: {where}", file=out)
    prompts = make_prompts(args.batch_size, model.config.vocab_size, args.seed)
    # One untimed warm-up each, so graph capture and first-call costs stay out of the figures.
    progress("decode", 0, 4, None)
    plain.generate(prompts[:1], 2)
    progress("decode", 1, 4, None)
    spec.generate(prompts[:1], 2)
    progress("decode", 2, 4, None)
    base = plain.generate(prompts, args.max_new_tokens)
    progress("decode", 3, 4, None)
    fast = spec.generate(prompts, args.max_new_tokens)
    progress("decode", 4, 4, None)
    identical = base.tokens == fast.tokens
    speedup = fast.tokens_per_second / base.tokens_per_second
    print(f"backend: {spec.backend_name} (device {spec.device}{', emulated' if args.emulate else ''})", file=out)
    print(f"weights: {str(model.spec.dtype).replace('torch.', '')}, KV cache: {str(pool.dtype).replace('torch.', '')}, "
          f"pages of {pool.page_size} tokens", file=out)
    print(f"requests: {len(prompts)}, prompt lengths {[len(p) for p in prompts]}, {args.max_new_tokens} new tokens each", file=out)
    print(f"plain greedy:     {base.tokens_per_second:8.1f} tokens/s  ({base.target_forwards} target forwards)", file=out)
    print(
        f"MTP (S={args.num_steps}):        {fast.tokens_per_second:8.1f} tokens/s  ({fast.target_forwards} target forwards)",
        file=out,
    )
    print(f"accept length:    {fast.mean_accept_length:.2f} of {args.num_steps + 1}", file=out)
    print(f"speedup:          {speedup:.2f}x", file=out)
    print(f"outputs identical: {'yes' if identical else 'no'}", file=out)
    if identical:
        return 0
    exact = model.spec.dtype == pool.dtype == torch.float32
    within = True
    for i, (a, b) in enumerate(zip(base.tokens, fast.tokens)):
        if a == b:
            continue
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if exact or first == min(len(a), len(b)):
            within = False
            print(f"  request {i} differs from token {first}", file=out)
            continue
        tie = near_tie(demo.float32_model, model, prompts[i] + list(a[:first]), a[first], b[first])
        within &= tie.within
        print(f"  request {i} departs at token {first}: {tie}", file=out)
    if not exact:
        print(f"MTP and greedy {'agree up to' if within else 'differ beyond'} {str(model.spec.dtype).replace('torch.', '')} "
              "rounding (README: low precision)", file=out)
    return 0 if within and not exact else 1


@attrs.frozen
class NearTie:
    """Two tokens' float32 logits after a prefix, against the rounding error of the low-precision
    model on that prefix (``delta``: its largest logit error, every position)."""

    gap: float  # |float32 logit of one token - of the other|
    below_best: float  # how far the lower of the two is below the float32 best
    delta: float

    @property
    def within(self) -> bool:
        return self.gap <= 2 * self.delta and self.below_best <= 2 * self.delta

    def __str__(self) -> str:
        return (f"float32 logits of the two tokens {self.gap:.4f} apart, {self.below_best:.4f} below the best; "
                f"rounding moves logits there by up to {self.delta:.4f}")


def _dense_logits(model: MiMoV2Flash, tokens: list[int]) -> torch.Tensor:
    device = model.lm_head.weight.device
    attend = DenseAttend(1, len(tokens), device)
    with torch.no_grad():
        hidden = model.target_hidden(torch.tensor(tokens, device=device), attend.positions, attend)
        return model.logits(hidden).to("cpu", torch.float32)


def near_tie(float32_model: MiMoV2Flash, low: MiMoV2Flash, prefix: list[int], a: int, b: int) -> NearTie:
    """How close tokens ``a`` and ``b`` are after ``prefix`` in float32, against ``low``'s rounding
    error on the same prefix (both models run densely over it, teacher-forced)."""
    exact, rounded = _dense_logits(float32_model, prefix), _dense_logits(low, prefix)
    last = exact[-1]
    x, y = float(last[a]), float(last[b])
    return NearTie(abs(x - y), float(last.max()) - min(x, y), float((rounded - exact).abs().max()))
