"""``benchmarks/vllm_speed.py`` runs (tiny), so an adapter change cannot break it unseen; its
figures are the README's, measured with the defaults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[3]


def test_vllm_speed_runs_and_both_engines_give_the_same_tokens() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/vllm_speed.py", "--models", "gqa8", "--prompt-lens", "16", "--new-tokens", "4",
                           "--repeats", "1"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| gqa8 | 16 | 4 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[-1] == "True"
    # Both backends' attention was timed inside the engine: builds, decode-step and prefill-step
    # layer calls took time.
    assert len(cells) == 11 and all(float(cell) > 0 for cell in cells[4:10]), row
