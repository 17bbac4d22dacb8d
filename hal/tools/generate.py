"""``hal generate``: greedy or MTP-speculative decoding of a MiMo-V2-Flash checkpoint on any backend.

Prompts are token-id lists (``--prompt-ids``, ``--prompts-file``) or text (``--prompt``, through
the directory's ``tokenizer.json`` and the ``tokenizers`` package). With ``--json`` stdout carries
exactly one JSON object; progress and messages go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from hal.distributed import init_tensor_parallel, launch_environment, shutdown
from hal.errors import CheckpointError, SpecError
from hal.spec import int_at_least
from hal.protocols import Backend
from hal.speculative import GenerationResult, GreedyDecoder, MultiLayerEagleWorker
from hal.speculative.checkpoint import Checkpoint
from hal.speculative.mimo import MiMoV2Flash
from hal.speculative.mimo_config import MiMoConfig
from hal.tools.cli import backend_from_args, check_kv_dtype_option, dtype_option
from hal.tools.demo import progress_printer
from hal.tools.tp_launch import run_ranks


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
        raise SpecError("give exactly one of --prompt-ids, --prompts-file, --prompt")
    if args.prompt_ids:
        try:
            return [[int(t) for t in args.prompt_ids.split(",")]], None
        except ValueError:
            raise SpecError(f"--prompt-ids must be comma-separated ints, got {args.prompt_ids!r}") from None
    if args.prompts_file:
        try:
            prompts = json.loads(Path(args.prompts_file).read_text())
        except OSError as exc:
            raise SpecError(f"--prompts-file {args.prompts_file}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise SpecError(f"--prompts-file {args.prompts_file}: not JSON ({exc})") from None
        except UnicodeDecodeError:
            raise SpecError(f"--prompts-file {args.prompts_file}: not a text file") from None
        ok = isinstance(prompts, list) and prompts and all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompts
        )
        if not ok:
            raise SpecError(f"{args.prompts_file}: expected a JSON list of non-empty token-id lists")
        return prompts, None
    tokenizer = _tokenizer(Path(args.model))
    return [tokenizer.encode(text).ids for text in args.prompt], tokenizer


def check_prompts(prompts: list[list[int]], config: MiMoConfig) -> None:
    """Refuse a token id outside the checkpoint's vocabulary, naming the prompt and position."""
    for i, prompt in enumerate(prompts):
        for j, token in enumerate(prompt):
            if not 0 <= token < config.vocab_size:
                raise SpecError(f"prompt {i} position {j}: token id {token} is outside the vocabulary 0..{config.vocab_size - 1}")


def decode(args: argparse.Namespace, prompts: list[list[int]], backend: Backend | None = None) -> GenerationResult:
    """Load the checkpoint (this rank's shard under tensor parallelism) and decode ``prompts``.

    ``backend`` is the one ``run`` resolved from ``--device`` (a spawned rank resolves it in its own
    process); a rank of a TP group (``RANK`` / ``WORLD_SIZE``
    / ``LOCAL_RANK`` in the environment, as torchrun and ``run_ranks`` set them) takes its device
    from it (``for_rank``) and joins the group over the backend's collective first."""
    rank, world_size, local_rank = launch_environment() or (0, 1, 0)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif world_size > 1:  # local ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = (backend or backend_from_args(args)).for_rank(local_rank)
    collective = backend.collective_backend if world_size > 1 else ""
    tp = init_tensor_parallel(collective, rank=rank, world_size=world_size, local_rank=local_rank, timeout_s=args.tp_timeout)
    try:
        show = progress_printer(sys.stderr)
        quiet = args.json or rank != 0
        dtype = dtype_option(args.dtype) or backend.preferred_dtype
        model = MiMoV2Flash.from_pretrained(args.model, dtype=dtype, tp=tp,
                                            progress=None if quiet else lambda d, t: show("loading weights", d, t, None))
        steps = draft_steps(args)
        engine_args: dict[str, Any] = {
            "page_size": args.page_size,
            "kv_dtype": dtype_option(args.kv_dtype),
            "max_batch_size": len(prompts),
            "max_seq_len": max(len(p) for p in prompts) + args.max_new_tokens + steps + 1,
        }
        engine = (MultiLayerEagleWorker(model, backend, num_steps=steps, **engine_args) if steps
                  else GreedyDecoder(model, backend, **engine_args))
        return engine.generate(prompts, args.max_new_tokens, eos_token_id=model.config.eos_token_ids)
    finally:
        shutdown(tp)


def draft_steps(args: argparse.Namespace) -> int:
    """MTP draft steps per iteration: ``--num-draft-steps`` (default 1) with ``--speculative mtp``,
    else 0 (the option alone is refused, not ignored)."""
    if args.speculative != "mtp":
        if args.num_draft_steps is not None:
            raise SpecError(f"--num-draft-steps {args.num_draft_steps} needs --speculative mtp")
        return 0
    return 1 if args.num_draft_steps is None else int(args.num_draft_steps)


def check_model_directory(directory: Path) -> None:
    """``--model`` names a checkpoint directory: a file or a missing path gets its own one line."""
    if directory.is_file():
        raise CheckpointError(f"--model {directory}: is a file; give the checkpoint directory that holds it "
                              f"(config.json and the safetensors), e.g. --model {directory.parent}")
    if not directory.exists():
        raise CheckpointError(f"--model {directory}: no such directory")
    if not directory.is_dir():
        raise CheckpointError(f"--model {directory}: not a directory")


def check_draft_steps(steps: int, directory: Path) -> None:
    """Refuse more draft steps than the checkpoint stores MTP layers, from its tensor names alone."""
    if not steps:
        return
    with Checkpoint(directory) as ckpt:
        available = len(ckpt.layer_indices("model.mtp.layers."))
    if steps > available:
        what = f"1..{available}" if available else "MTP layers, and the checkpoint has none (model.mtp.layers.*)"
        raise SpecError(f"--num-draft-steps {steps}: --speculative mtp needs {what}")


def run(args: argparse.Namespace) -> int:
    """Load, decode, print (or emit one JSON object); exit 0. ``--tp N`` runs N local ranks; under
    torchrun each process is one rank and rank 0 prints."""
    check_model_directory(Path(args.model))
    prompts, tokenizer = read_prompts(args)
    config = MiMoConfig.from_file(Path(args.model) / "config.json")
    check_prompts(prompts, config)  # before any weight loads
    check_draft_steps(draft_steps(args), Path(args.model))
    backend = backend_from_args(args)  # an unknown or unavailable device fails before loading
    spec = config.model_spec()
    check_kv_dtype_option(backend, spec.target_layers + spec.draft_layers[: draft_steps(args)], args)
    int_at_least(args.tp, 1, "--tp")
    launched = launch_environment()
    if launched is not None:
        result = decode(args, prompts, backend)
        if launched[0] != 0:
            return 0
    elif args.tp > 1:
        result = run_ranks(decode, args.tp, args, prompts)[0]
    else:
        result = decode(args, prompts, backend)
    steps = draft_steps(args)
    tokens = [list(t) for t in result.tokens]
    if args.json:
        accept = result.mean_accept_length if result.accept_lengths else None
        print(json.dumps({"tokens": tokens, "tokens_per_second": result.tokens_per_second, "accept_length": accept,
                          "target_forwards": result.target_forwards, "request_verifies": len(result.accept_lengths)}))
        return 0
    for i, row in enumerate(tokens):
        print(f"[{i}] {row}" + (f"\n    {tokenizer.decode(row)!r}" if tokenizer is not None else ""))
    accepted = f", accept length {result.mean_accept_length:.2f} of {steps + 1}" if steps else ""
    print(f"{result.num_generated} tokens in {result.seconds:.2f}s ({result.tokens_per_second:.1f} tokens/s), "
          f"{result.target_forwards} target forwards{accepted}", file=sys.stderr)
    return 0
