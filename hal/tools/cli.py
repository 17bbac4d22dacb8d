"""The ``hal`` command: ``info``, ``demo``, ``conformance``, ``bench``, ``generate``.

The parser (every command's options) is defined here and imports nothing heavy, so ``hal --help``,
``hal CMD --help`` and ``hal --version`` never import torch; a command's implementation module is
imported only when that command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import hal
from hal.errors import BackendUnavailableError, HalError

DEVICE_HELP = "hal device string: cpu, npu, npu:1, cuda, auto, or a plug-in's type (default: cpu)"


def _device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help=DEVICE_HELP)
    parser.add_argument("--emulate", action="store_true", help="run the backend on its CPU emulator (npu, cuda)")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line on stderr (``hal generate: argument --x: ...``), exit 2;
    ``commands``: the sub-command parsers by name (they report their own bad options)."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def _threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def dtype_option(name: str) -> Any:
    """A ``--dtype``/``--kv-dtype`` choice as a ``torch.dtype``; None for ``auto`` (the backend decides)."""
    import torch  # only when a command runs

    return None if name == "auto" else getattr(torch, name)


def check_kv_dtype_option(backend: Any, layers: Any, args: argparse.Namespace) -> None:
    """``--kv-dtype X`` that the backend's kernel cannot store these layers in (where its own
    preferred KV dtype would do) is refused now, naming the option, before any training or loading."""
    from hal.errors import UnsupportedConfigError

    kv = dtype_option(args.kv_dtype)
    if kv is None:
        return
    page = args.page_size or backend.default_page_size
    for layer in layers:
        reason = backend.unsupported_reason(layer, kv, page, max_q_len=2)
        if reason is not None and backend.unsupported_reason(layer, backend.kv_dtype_preference[0], page, max_q_len=2) is None:
            raise UnsupportedConfigError(f"--kv-dtype {args.kv_dtype}: backend {backend.name!r}, layer {layer.layer_id}: {reason}")


def _kv_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="dtype the weights load in; auto = the backend's preferred one (float32 on cpu, bfloat16 on npu and cuda)")
    parser.add_argument("--page-size", type=positive_int, default=None, help="KV page size (default: the backend's default_page_size)")
    parser.add_argument("--kv-dtype", choices=DTYPE_CHOICES, default="auto",
                        help="KV cache dtype; auto = the weights' dtype where the backend's kernel takes it, "
                             "else the backend's first that it takes (bfloat16 on npu)")


def _info_options(parser: argparse.ArgumentParser) -> None:
    """``hal info`` takes no options."""


def add_demo_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``hal demo`` (also taken by benchmarks/spec_decode.py)."""
    _device_options(parser)
    parser.add_argument("--num-steps", type=positive_int, default=3, help="MTP draft steps S (default: 3)")
    parser.add_argument("--train-steps", type=positive_int, default=None, help="MTP distillation steps (default: DistillConfig's)")
    parser.add_argument("--train-sequences", type=positive_int, default=None,
                        help="greedy continuations to distil on (default: DistillConfig's)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens generated per request")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="number of prompts")
    _kv_options(parser)
    _threads_option(parser)
    parser.add_argument("--seed", type=int, default=0, help="model and prompt seed")
    parser.add_argument("--no-cache", action="store_true", help="retrain the MTP blocks even if cached")
    parser.add_argument("--export", type=Path, default=None, metavar="DIR",
                        help="also write the demo's MiMo-V2-Flash checkpoint (config.json + safetensors, MTP layers included) to DIR")


def _conformance_options(parser: argparse.ArgumentParser) -> None:
    _device_options(parser)
    parser.add_argument("--quick", action="store_true", help="a covering subset: every feature, fewer shapes (for slow emulators)")
    parser.add_argument("-k", "--select", action="append", default=[], metavar="TEXT",
                        help="only checks whose name or feature contains TEXT (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every check as it finishes")


def _bench_options(parser: argparse.ArgumentParser) -> None:
    _device_options(parser)
    parser.add_argument("--out", default="bench-results", type=Path, help="directory for results.md/.csv/.png (default: ./bench-results)")
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (a smoke run)")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed samples per side (default 15, quick 5)")
    parser.add_argument("--speculative", action="store_true",
                        help="also time plain greedy vs the MTP worker (distils the MTP blocks once)")
    parser.add_argument("--plain", action="store_true",
                        help="also time hal greedy and MTP against a plain decoder (contiguous KV cache + SDPA) on the demo model")
    parser.add_argument("--transformers", action="store_true",
                        help="also time hal greedy and MTP against transformers' generate on the same checkpoint")
    _threads_option(parser)


def _generate_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="MiMo-V2-Flash checkpoint directory (config.json + safetensors)")
    _device_options(parser)
    prompts = parser.add_argument_group("prompts (exactly one)")
    prompts.add_argument("--prompt-ids", help="one prompt as comma-separated token ids, e.g. 1,2,3")
    prompts.add_argument("--prompts-file", type=Path, help="a JSON list of token-id lists")
    prompts.add_argument("--prompt", action="append", help="a text prompt (repeatable; needs DIR/tokenizer.json)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens generated per prompt (default: 32)")
    parser.add_argument("--speculative", choices=["none", "mtp"], default="none", help="MTP speculative decoding (default: none)")
    parser.add_argument("--num-draft-steps", type=positive_int, default=None,
                        help="MTP draft steps S with --speculative mtp (default: 1)")
    _kv_options(parser)
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor-parallel ranks: N local processes on the device type, over its collective (default: 1)")
    parser.add_argument("--tp-timeout", type=positive_float, default=60.0,
                        help="seconds a collective waits for its peers before the rank fails (default: 60)")
    _threads_option(parser)
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")


# command -> (implementation module with run(args) -> int, help, options)
COMMANDS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = {
    "info": ("hal.tools.info", "list registered backends, their availability and versions", _info_options),
    "demo": ("hal.tools.demo", "run the tiny MiMo-V2-style model with and without MTP speculative decoding", add_demo_options),
    "conformance": ("hal.tools.conformance.command", "run the conformance suite against a backend", _conformance_options),
    "bench": ("hal.tools.bench", "benchmark a backend against plain torch baselines", _bench_options),
    "generate": ("hal.tools.generate", "decode a MiMo-V2-Flash checkpoint, greedy or with MTP", _generate_options),
}


def build_parser() -> _Parser:
    """The ``hal`` parser with one sub-command per entry of ``COMMANDS`` (imports no implementation)."""
    parser = _Parser(prog="hal", description="hal: hardware abstraction layer for LLM inference engines")
    parser.add_argument("--version", action="version", version=f"hal {hal.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}
    for name, (module_name, help_text, add_options) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        add_options(p)
        parser.commands[name] = p
    return parser


def backend_from_args(args: argparse.Namespace) -> Any:
    """``hal.get_backend(args.device, emulate=args.emulate)``; an unavailable device that has an
    emulator gets an error saying that ``--emulate`` runs it here."""
    from hal.registry import get_backend, has_emulator, parse_device

    try:
        return get_backend(args.device, emulate=args.emulate)
    except BackendUnavailableError as exc:
        device_type, _ = parse_device(args.device)
        if args.emulate or not has_emulator(device_type):
            raise
        raise BackendUnavailableError(f"{exc} (or add --emulate to run it here on its CPU emulator)") from exc


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; hal and file-system errors become a one-line message and exit code 1."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # reported by the command that was given them (hal generate: ...), not by hal
            parser.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # --help, --version, or a bad option (one line on stderr)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _run_command(args)
    except KeyboardInterrupt:  # Ctrl-C, at any point of the command (its imports included)
        print(f"hal {args.command}: interrupted", file=sys.stderr)
        return 130


def _run_command(args: argparse.Namespace) -> int:
    """Import the command's module and run it; hal and file-system errors become one line."""
    try:
        module = importlib.import_module(args._module)
    except ImportError as exc:  # an optional dependency of this command only; hal's own modules must import
        if (exc.name or "").partition(".")[0] == "hal":
            raise
        print(f"hal {args.command}: unavailable ({exc})", file=sys.stderr)
        return 3
    try:
        code = int(module.run(args) or 0)
        sys.stdout.flush()  # a reader that left shows here, not at interpreter exit
        return code
    except HalError as exc:
        print(f"hal {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader left (hal conformance --list | head -1): not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except OSError as exc:  # e.g. an output directory that cannot be written
        print(f"hal {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
