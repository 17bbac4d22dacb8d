"""``hal bench``'s outputs: the markdown table, results.md / .csv / .png."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from hal.tools.measurement import HEADER, Measurement

def markdown_table(results: Sequence[Measurement]) -> str:
    """The results as a markdown table (the README's and results.md's format)."""
    rows = [HEADER, ["---"] * len(HEADER), *(m.cells() for m in results)]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def write_outputs(results: Sequence[Measurement], out_dir: Path, title: str) -> list[Path]:
    """results.md, results.csv and results.png (ratios with their targets) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, csv_path, png = out_dir / "results.md", out_dir / "results.csv", out_dir / "results.png"
    md.write_text(f"{title}\n\n{markdown_table(results)}\n")
    with csv_path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(HEADER)
        writer.writerows([m.name, m.hal, m.baseline, m.unit, m.ratio, m.spread_text,
                          m.ratio_of, m.target, m.met] for m in results)
    _plot(results, png, title)
    return [md, csv_path, png]


def better_direction(m: Measurement) -> str:
    """``"higher"`` or ``"lower"``: which way the ratio improves (from the target, else from what it measures)."""
    if m.target:
        return "higher" if m.target.startswith(">=") else "lower"
    return "lower" if ("time" in m.ratio_of or "%" in m.ratio_of) and "saving" not in m.ratio_of else "higher"


def _plot(results: Sequence[Measurement], path: Path, title: str) -> None:
    """Horizontal bars with their spread, one panel per kind of ratio (``ratio_of``); log scale where
    a panel's ratios span more than 20x; each panel says which direction is better."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds: dict[str, list[Measurement]] = {}
    for m in results:
        kinds.setdefault(m.ratio_of, []).append(m)
    heights = [len(rows) + 1.2 for rows in kinds.values()]
    fig, axes = plt.subplots(len(kinds), 1, figsize=(12, 0.45 * sum(heights) + 1.5),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (kind, rows) in zip(axes[:, 0], kinds.items()):
        colors = ["tab:gray" if m.met is None else ("tab:green" if m.met else "tab:red") for m in rows]
        values = [m.ratio for m in rows]
        positive = [v for v in values if v > 0]
        log = bool(positive) and len(positive) == len(values) and max(positive) / min(positive) > 20
        spreads = [m.spread for m in rows if m.spread is not None]
        errors = [[m.ratio - lo for m, (lo, _) in zip(rows, spreads)], [hi - m.ratio for m, (_, hi) in zip(rows, spreads)]] \
            if len(spreads) == len(rows) else None
        ax.barh(range(len(rows)), values, color=colors, xerr=errors, ecolor="black", capsize=3)
        for i, m in enumerate(rows):
            if m.target:
                bound = float(m.target.split()[-1])
                ax.plot([bound, bound], [i - 0.4, i + 0.4], color="black", linewidth=2)
            ax.text(max(m.ratio, 0) if not m.spread else max(m.spread[1], 0), i, f" {m.ratio:.3g}" + (" (noisy)" if m.noisy else ""),
                    va="center", fontsize=8)
        if log:
            ax.set_xscale("log")
        names = ["\n".join(textwrap.wrap(m.name, 70)) for m in rows]
        ax.set_yticks(range(len(rows)), names, fontsize=7)
        ax.invert_yaxis()
        arrow = "higher is better \u2192" if better_direction(rows[0]) == "higher" else "\u2190 lower is better"
        ax.set_xlabel(f"{kind}{' (log scale)' if log else ''}    {arrow}", fontsize=8)
        ax.margins(x=0.15)
    fig.suptitle("\n".join(textwrap.wrap(title + " | bars: median of paired ratios, whiskers: their range; black tick: "
                                          "target; green met, red missed, gray no target", 120)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # long row labels widen the figure instead of being cut
    plt.close(fig)
