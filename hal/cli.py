"""The ``hal`` command: ``info``, ``demo``, ``conformance``, ``bench``.

Each command's implementation is imported only when that command runs, so ``hal info``
stays cheap and a missing optional dependency only affects the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from hal.errors import HalError

# command -> (module, help); the module provides add_arguments(parser) and run(args) -> int
COMMANDS = {
    "info": ("hal.cli", "list registered backends, their availability and versions"),
    "demo": ("speculative.demo", "run the tiny MiMo-V2-style model with and without MTP speculative decoding"),
    "conformance": ("hal.conformance", "run the conformance suite against a backend"),
    "bench": ("hal.bench", "benchmark a backend against plain torch baselines"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hal info`` takes no options."""


def run(args: argparse.Namespace) -> int:
    """``hal info``: one row per registered backend."""
    import torch

    from hal.registry import list_backends

    rows = [("device", "available", "devices", "collective", "source", "details")]
    for info in list_backends():
        a = info.availability
        collective = "-"
        try:
            from hal.registry import _resolve_class

            collective = getattr(_resolve_class(info.device_type), "collective_backend", "-")
        except HalError:
            pass
        versions = ", ".join(f"{k} {v}" for k, v in a.versions.items())
        details = a.reason + (f" ({versions})" if versions else "")
        rows.append((info.device_type, "yes" if a.available else "no", str(a.device_count), collective, info.source, details))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    print(f"\nhal {__import__('hal').__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``hal`` parser with one sub-command per entry of ``COMMANDS``."""
    parser = argparse.ArgumentParser(prog="hal", description="hal: hardware abstraction layer for LLM inference engines")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        try:
            importlib.import_module(module_name).add_arguments(p)
        except ImportError as exc:
            p.set_defaults(_import_error=str(exc))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; hal and file-system errors become a one-line message and exit code 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_import_error", None):
        print(f"hal {args.command}: unavailable ({args._import_error})", file=sys.stderr)
        return 3
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except HalError as exc:
        print(f"hal {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. an output directory that cannot be written
        print(f"hal {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
