"""``benchmarks/sglang_speed.py`` runs (its attention step, tiny), so an adapter change cannot break
it unseen; its figures are the README's, measured with the defaults."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

REPO = Path(__file__).resolve().parents[3]


def test_sglang_speed_attention_step_runs_and_the_backends_agree() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/sglang_speed.py", "--attention-step", "--kv-lens", "140", "--threads", "1",
                           "--repeats", "1"], cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| 1 | 140 |" in proc.stdout and "largest output difference between the backends" in proc.stdout
