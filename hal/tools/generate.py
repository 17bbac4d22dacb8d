"""``hal generate``: greedy or MTP-speculative decoding of a MiMo-V2-Flash checkpoint on any backend.

Prompts are token-id lists (``--prompt-ids``, ``--prompts-file``) or text (``--prompt``, through
the directory's ``tokenizer.json`` and the ``tokenizers`` package). With ``--json`` stdout carries
exactly one JSON object; progress and messages go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from hal.errors import CheckpointError, SpecError
from hal.speculative import GreedyDecoder, MultiLayerEagleWorker
from hal.speculative.mimo import MiMoV2Flash
from hal.tools.cli import backend_from_args
from hal.tools.demo import progress_printer, with_kv_dtype


def _tokenizer(directory: Path) -> Any:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"text prompts need {path}; give token ids with --prompt-ids or --prompts-file")
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise CheckpointError("text prompts need the tokenizers package (pip install tokenizers)") from exc
    return Tokenizer.from_file(str(path))


def read_prompts(args: argparse.Namespace) -> tuple[list[list[int]], Any]:
    """Token-id prompts from exactly one of the prompt options, and the tokenizer if text was given."""
    given = [name for name in ("prompt_ids", "prompts_file", "prompt") if getattr(args, name)]
    if len(given) != 1:
        raise SpecError("hal generate: give exactly one of --prompt-ids, --prompts-file, --prompt")
    if args.prompt_ids:
        try:
            return [[int(t) for t in args.prompt_ids.split(",")]], None
        except ValueError:
            raise SpecError(f"--prompt-ids must be comma-separated ints, got {args.prompt_ids!r}") from None
    if args.prompts_file:
        prompts = json.loads(Path(args.prompts_file).read_text())
        ok = isinstance(prompts, list) and prompts and all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompts
        )
        if not ok:
            raise SpecError(f"{args.prompts_file}: expected a JSON list of non-empty token-id lists")
        return prompts, None
    tokenizer = _tokenizer(Path(args.model))
    return [tokenizer.encode(text).ids for text in args.prompt], tokenizer


def run(args: argparse.Namespace) -> int:
    """Load, decode, print (or emit one JSON object); exit 0."""
    prompts, tokenizer = read_prompts(args)
    backend_from_args(args)  # an unknown or unavailable device fails before loading
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    show = progress_printer(sys.stderr)
    model = MiMoV2Flash.from_pretrained(args.model, progress=None if args.json else lambda d, t: show("loading weights", d, t, None))
    steps = args.num_draft_steps if args.speculative == "mtp" else 0
    available = model.config.num_mtp_layers
    if steps and not 1 <= steps <= available:
        what = f"1..{available}" if available else "MTP layers, and the checkpoint has none (model.mtp.layers.*)"
        raise SpecError(f"--num-draft-steps {steps}: --speculative mtp needs {what}")
    engine_args: dict[str, Any] = {
        "emulate": args.emulate,
        "page_size": args.page_size,
        "max_batch_size": len(prompts),
        "max_seq_len": max(len(p) for p in prompts) + args.max_new_tokens + steps + 1,
    }

    def build(dtype: torch.dtype) -> GreedyDecoder | MultiLayerEagleWorker:
        if steps:
            return MultiLayerEagleWorker(model, args.device, num_steps=steps, kv_dtype=dtype, **engine_args)
        return GreedyDecoder(model, args.device, kv_dtype=dtype, **engine_args)

    engine, _ = with_kv_dtype(args.kv_dtype, build)
    result = engine.generate(prompts, args.max_new_tokens, eos_token_id=model.config.eos_token_id)
    tokens = [list(t) for t in result.tokens]
    if args.json:
        accept = result.mean_accept_length if result.accept_lengths else None
        print(json.dumps({"tokens": tokens, "tokens_per_second": result.tokens_per_second, "accept_length": accept,
                          "target_forwards": result.target_forwards}))
        return 0
    for i, row in enumerate(tokens):
        print(f"[{i}] {row}" + (f"\n    {tokenizer.decode(row)!r}" if tokenizer is not None else ""))
    accepted = f", accept length {result.mean_accept_length:.2f} of {steps + 1}" if steps else ""
    print(f"{result.num_generated} tokens in {result.seconds:.2f}s ({result.tokens_per_second:.1f} tokens/s), "
          f"{result.target_forwards} target forwards{accepted}", file=sys.stderr)
    return 0
