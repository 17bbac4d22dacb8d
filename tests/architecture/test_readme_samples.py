"""The README's sample outputs have the shape of the real output: the same lines and columns, in
the same format, figures aside (they vary with the machine)."""

from __future__ import annotations

import io
import re
import tempfile
from pathlib import Path

import attrs
import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def shape(line: str) -> str:
    """A line with its figures, paths and bar fill taken out: what must not drift."""
    line = re.sub(r"(^|\s)/\S+", r"\1PATH", line)
    line = re.sub(r"\[[#.]+\]", "[BAR]", line)
    line = re.sub(r"-?\d[\d,]*(\.\d+)?(e[+-]?\d+)?", "N", line)
    line = re.sub(r"N(, N)+", "N", line)  # a list of figures: [5, 8, 11, 14]
    return re.sub(r"\s+", " ", line).strip()


def readme_sample(first_line: str) -> list[str]:
    """The lines of the README's bare code block that starts with ``first_line``."""
    block: list[str] | None = None
    fenced = False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            if not fenced:
                block = [] if line == "```" else None  # a bare fence: output, not code
            elif block and block[0].startswith(first_line):
                return block
            fenced = not fenced
        elif fenced and block is not None:
            block.append(line)
    raise AssertionError(f"README: no sample output starting with {first_line!r}")


def readme_tables(header_start: str) -> list[list[str]]:
    """The README's markdown tables whose header row starts with ``header_start``, as their lines."""
    tables, current = [], None
    for line in README.read_text().splitlines():
        if line.startswith(header_start):
            current = []
            tables.append(current)
        if current is not None:
            if not line.startswith("|"):
                current = None
                continue
            current.append(line)
    return tables


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def test_the_demo_sample_has_the_demo_output_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The README's ``hal demo`` sample (a run whose MTP blocks come from the cache) against a real
    run's output, line for line."""
    from hal.tools import demo
    from hal.tools.cli import build_parser

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the MTP cache lives in the temp dir
    args = build_parser().parse_args(["demo", "--train-steps", "5", "--train-sequences", "8", "--max-new-tokens", "6"])
    demo.run(args, out=io.StringIO())  # trains and caches
    out = io.StringIO()
    assert demo.run(args, out=out) == 0  # loads from the cache, as the sample did
    sample = readme_sample("MTP blocks: loaded from")
    assert [shape(line) for line in sample] == [shape(line) for line in out.getvalue().splitlines()]


def test_the_bench_table_has_the_columns_and_formats_hal_bench_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every README table in ``hal bench``'s format has its header, its title line above it, and in
    every row its number of cells and its spread format."""
    import hal.tools.bench
    from hal.tools.cli import main

    tiny = attrs.evolve(hal.tools.bench.BenchConfig.quick(), decode_batch=2, decode_kv_len=160, extend_len=96,
                        write_tokens=256, q_heads=8, kv_heads=2, repeats=3, warmup=1, min_sample_s=0.0)
    monkeypatch.setattr(hal.tools.bench.BenchConfig, "quick", classmethod(lambda cls: tiny))
    assert main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    written = (tmp_path / "results.md").read_text().splitlines()
    title, header, separator, rows = written[0], written[2], written[3], written[4:]
    spreads = {cells(r)[cells(header).index("spread")] for r in rows} - {""}
    assert spreads, "the bench run measured no spread to compare against"
    spread_shapes = {shape(s) for s in spreads}
    tables = readme_tables("| benchmark |")
    assert tables, "README: no hal bench table"
    text = README.read_text().splitlines()
    for table in tables:
        assert table[0] == header and table[1] == separator
        above = text[text.index(table[0]) - 2]  # results.md: the title, a blank line, the table
        assert shape(above) == shape(title), above
        column = cells(header).index("spread")
        for row in table[2:]:
            assert len(cells(row)) == len(cells(header)), row
            spread = cells(row)[column]
            assert spread == "" or shape(spread) in spread_shapes, row
