"""``hal conformance``: run the suite on one backend and print the per-feature table."""

from __future__ import annotations

import argparse
import sys
import time

from hal.tools.cli import backend_from_args
from hal.tools.conformance import CheckResult, Status, build_suite, format_table, run_suite


def run(args: argparse.Namespace) -> int:
    """``hal conformance``: print the per-feature table; exit 1 if any check failed."""
    checks = build_suite(quick=args.quick, select=args.select)
    if args.list:
        for check in checks:
            print(f"{check.name}    ({', '.join(check.features)})")
        return 0
    if not checks:
        print(f"hal conformance: no check matches {args.select}", file=sys.stderr)
        return 2
    backend = backend_from_args(args)
    mode = " (emulated)" if args.emulate else ""
    print(f"hal conformance: backend {backend.name!r} on {backend.device}{mode}, {len(checks)} checks")

    def progress(i: int, n: int, result: CheckResult) -> None:
        if args.verbose or result.status is Status.FAILED:
            print(f"[{i}/{n}] {result.status.value:<11} {result.check.name} ({result.seconds:.2f}s)", file=sys.stderr)
            if result.detail and (args.verbose or result.status is Status.FAILED):
                print(f"    {result.detail}", file=sys.stderr)

    start = time.perf_counter()
    results = run_suite(backend, checks, progress=progress)
    print(format_table(results))
    failed = [r for r in results if r.status is Status.FAILED]
    unsupported = [r for r in results if r.status is Status.UNSUPPORTED]
    if unsupported:
        reasons: dict[str, int] = {}
        for r in unsupported:
            reasons[r.detail] = reasons.get(r.detail, 0) + 1
        print("\nunsupported (reason: count):")
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            print(f"  {reason}: {count}")
    if failed:
        print("\nfailed:")
        for r in failed:
            print(f"  {r.check.name}: {r.detail}")
    print(f"\n{len(results) - len(failed) - len(unsupported)} passed, {len(failed)} failed, "
          f"{len(unsupported)} unsupported in {time.perf_counter() - start:.1f}s")
    return 1 if failed else 0
