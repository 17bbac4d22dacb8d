"""``hal info``: one row per registered backend, with its availability and why."""

from __future__ import annotations

import argparse
import sys

import torch

import hal
from hal.registry import list_backends


def run(args: argparse.Namespace) -> int:
    """Print the table of backends, then the versions of hal, torch and Python."""
    rows = [("device", "available", "devices", "collective", "auto", "source", "details")]
    for info in list_backends():
        a = info.availability
        versions = ", ".join(f"{k} {v}" for k, v in a.versions.items())
        details = a.reason + (f" ({versions})" if versions else "")
        auto = "-" if info.auto_priority is None else str(info.auto_priority)
        rows.append((info.device_type, "yes" if a.available else "no", str(a.device_count), info.collective_backend,
                     auto, info.source, details))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    print(f"\nhal {hal.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    return 0
