"""The conformance framework: checks, results, the runner, the per-feature table, and the assertion
helpers every check uses (each failure a ``ConformanceFailure`` naming what differed)."""

from __future__ import annotations

import zlib
import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from hal.errors import UnsupportedConfigError
from hal.protocols import Backend, KVPool
from hal.tools.testing import TOLERANCE, read_kv


class Status(enum.Enum):
    """Outcome of one check."""

    PASSED = "passed"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"


class ConformanceFailure(AssertionError):
    """A backend result that breaks the contract (the check's message says how)."""


@attrs.frozen
class Check:
    """One conformance check: ``fn(backend)`` returns on success, raises otherwise."""

    name: str
    features: tuple[str, ...]
    fn: Callable[[Backend], None] = attrs.field(repr=False)


@attrs.frozen
class CheckResult:
    """A check's status, why (failure or unsupported reason) and how long it took."""

    check: Check
    status: Status
    detail: str = ""
    seconds: float = 0.0


@attrs.frozen
class FeatureRow:
    """Counts of one feature in the report table."""

    feature: str
    passed: int
    failed: int
    unsupported: int


def run_check(backend: Backend, check: Check) -> CheckResult:
    """Run one check; UnsupportedConfigError means unsupported, any other exception failed."""
    start = time.perf_counter()
    try:
        check.fn(backend)
    except UnsupportedConfigError as exc:
        return CheckResult(check, Status.UNSUPPORTED, str(exc), time.perf_counter() - start)
    except ConformanceFailure as exc:
        return CheckResult(check, Status.FAILED, str(exc), time.perf_counter() - start)
    except Exception as exc:  # a crash is a failure too, reported with its type
        return CheckResult(check, Status.FAILED, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
    return CheckResult(check, Status.PASSED, "", time.perf_counter() - start)


def run_suite(
    backend: Backend,
    checks: Sequence[Check],
    *,
    progress: Callable[[int, int, CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run ``checks`` in order on ``backend``; ``progress(i, n, result)`` after each."""
    results = []
    for i, check in enumerate(checks):
        result = run_check(backend, check)
        results.append(result)
        if progress is not None:
            progress(i + 1, len(checks), result)
    return results


def summarize(results: Sequence[CheckResult]) -> list[FeatureRow]:
    """Counts per feature, in the order features first appear; a check counts in each of its features."""
    counts: dict[str, dict[Status, int]] = {}
    for result in results:
        for feature in result.check.features:
            row = counts.setdefault(feature, {s: 0 for s in Status})
            row[result.status] += 1
    return [FeatureRow(f, c[Status.PASSED], c[Status.FAILED], c[Status.UNSUPPORTED]) for f, c in counts.items()]


def format_table(results: Sequence[CheckResult]) -> str:
    """A markdown table: one row per feature, then the total over distinct checks."""
    rows = [(r.feature, str(r.passed), str(r.failed), str(r.unsupported)) for r in summarize(results)]
    total = {s: sum(1 for r in results if r.status is s) for s in Status}
    rows.append(
        (
            f"**total ({len(results)} checks)**",
            str(total[Status.PASSED]),
            str(total[Status.FAILED]),
            str(total[Status.UNSUPPORTED]),
        )
    )
    header = ("feature", "passed", "failed", "unsupported")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


# shared helpers of the checks


def fail(message: str) -> None:
    raise ConformanceFailure(message)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def seeded(*tag: object) -> torch.Generator:
    """A generator whose stream depends only on ``tag`` (identical in every run and world)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(tag).encode()))


def randn(shape: Sequence[int], dtype: torch.dtype, *tag: object) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=seeded(*tag)).to(dtype)


def host(t: torch.Tensor) -> torch.Tensor:
    """A float32 host copy (never a view: graph outputs are overwritten by the next replay)."""
    return t.detach().to("cpu", torch.float32, copy=True)


def snapshot(pool: KVPool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Host copies of every layer's K and V rows."""
    return [read_kv(pool, layer) for layer in range(pool.spec.num_layers)]


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    diff = (before != after).flatten(1).any(1) if before.numel() else torch.zeros(0, dtype=torch.bool)
    return set(torch.nonzero(diff).flatten().tolist())


def assert_only_rows_changed(
    pool: KVPool,
    before: list[tuple[torch.Tensor, torch.Tensor]],
    allowed: Mapping[int, set[int]],
    what: str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fail if any layer's K or V changed outside ``allowed[layer]`` rows; returns the new snapshot."""
    after = snapshot(pool)
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, after)):
        for name, a, b in (("K", k0, k1), ("V", v0, v1)):
            stray = sorted(changed_rows(a, b) - allowed.get(layer, set()))
            if stray:
                fail(f"{what} changed layer {layer} {name} rows {stray[:8]} it must not touch")
    return after


def assert_close(got: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOLERANCE[dtype]
    got_c, exp_c = got.detach().to("cpu").float(), expect.detach().to("cpu").float()
    if got_c.shape != exp_c.shape:
        fail(f"{what}: shape {tuple(got_c.shape)}, expected {tuple(exp_c.shape)}")
    if not torch.allclose(got_c, exp_c, atol=atol, rtol=rtol):
        err = float((got_c - exp_c).abs().max())
        fail(f"{what}: max |err| {err:.3g} exceeds atol {atol} + rtol {rtol} ({dtype_name(dtype)})")


def expect_error(
    expected: type[Exception], call: Callable[[], Any], what: str, mentions: Iterable[str] = ()
) -> None:
    try:
        call()
    except expected as exc:
        message = str(exc)
        missing = [m for m in mentions if m not in message]
        if missing:
            fail(f"{what}: {type(exc).__name__} message {message!r} does not name {missing}")
        return
    except UnsupportedConfigError:
        raise
    except Exception as exc:
        fail(f"{what}: raised {type(exc).__name__} ({exc}), expected hal.errors.{expected.__name__}")
    fail(f"{what}: did not raise, expected hal.errors.{expected.__name__}")
