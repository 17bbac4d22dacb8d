"""One row of ``hal bench``'s results (``Measurement``) and how a row is judged from paired ratios."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import attrs


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
