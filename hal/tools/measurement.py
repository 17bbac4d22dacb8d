"""How ``hal bench`` measures: two functions timed alternately (``time_pair``), one row of the
results (``Measurement``) and how a row is judged from paired ratios."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from hal.protocols import Backend


@attrs.frozen
class Measurement:
    """One row of the results table. ``ratio`` is hal relative to the baseline, as ``ratio_of`` says."""

    name: str
    hal: float
    baseline: float
    unit: str
    ratio: float
    ratio_of: str  # what the ratio means, e.g. "hal/copy throughput"
    target: str = ""
    met: bool | None = None
    spread: tuple[float, float] | None = None  # lowest and highest of the paired ratios

    @property
    def noisy(self) -> bool:
        """Whether the spread is too wide to judge: the paired ratios vary by more than 1.5x, or the
        target's bound lies inside them (the verdict could go either way)."""
        if self.spread is None:
            return False
        low, high = self.spread
        if low <= 0 or high / low > 1.5:
            return True
        return bool(self.target) and low <= float(self.target.split()[-1]) <= high

    @property
    def spread_text(self) -> str:
        """The spread as 'low to high' (a dash would garble negative bounds), '' where there is none."""
        return "" if self.spread is None else f"{self.spread[0]:.3g} to {self.spread[1]:.3g}"

    def cells(self) -> list[str]:
        """The row's cells in ``HEADER`` order."""
        met = "" if self.met is None else ("yes" if self.met else "**no**")
        if self.noisy:
            met = (met + " (noisy)").strip()
        return [self.name, _fmt(self.hal), _fmt(self.baseline), self.unit, f"{self.ratio:.3g}", self.spread_text, self.ratio_of,
                self.target, met]


HEADER = ["benchmark", "hal", "baseline", "unit", "ratio", "spread", "ratio is", "target", "met"]


def judged(name: str, hal: float, baseline: float, unit: str, ratios: Sequence[float], ratio_of: str, target: str = "") -> Measurement:
    """A row from paired ratios: their median, their spread, and the verdict against ``target``
    (``">= x"`` or ``"<= x"``) from the median."""
    ratio = statistics.median(ratios)
    met = None
    if target:
        op, bound = target.split()
        met = ratio >= float(bound) if op == ">=" else ratio <= float(bound)
    return Measurement(name, hal, baseline, unit, ratio, ratio_of, target, met, (min(ratios), max(ratios)))


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:,.0f}"


def seconds_per_call(backend: Backend, fn: Callable[[], Any], inner: int) -> float:
    """Mean seconds of ``inner`` back-to-back calls of ``fn``, the device synchronised around them."""
    backend.synchronize()
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    backend.synchronize()
    return (time.perf_counter() - start) / inner


@attrs.frozen
class PairTiming:
    """Seconds per call of two alternately timed functions, and their ratio.

    ``a_over_b`` is the median of the per-pair ratios: neighbouring samples share the machine's
    load at that moment, so drifting load cancels out of it where it would not from a ratio of
    two medians.
    """

    a: float
    b: float
    a_over_b: float
    ratios: tuple[float, ...] = ()  # every per-pair a/b


def time_pair(
    backend: Backend,
    a: Callable[[], Any],
    b: Callable[[], Any],
    *,
    repeats: int,
    warmup: int,
    min_sample_s: float = 0.0,
    stat: Callable[[list[float]], float] = statistics.median,
) -> PairTiming:
    """``a`` and ``b`` timed alternately after ``warmup`` calls each; ``stat`` (median by default)
    of each side's samples."""
    for _ in range(warmup):
        a()
        b()
    inner = []
    for fn in (a, b):
        once = seconds_per_call(backend, fn, 1)
        inner.append(max(1, math.ceil(min_sample_s / max(once, 1e-9))))
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(seconds_per_call(backend, a, inner[0]))
        tb.append(seconds_per_call(backend, b, inner[1]))
    ratios = tuple(x / max(y, 1e-12) for x, y in zip(ta, tb))
    return PairTiming(stat(ta), stat(tb), statistics.median(ratios), ratios)
