"""Every script under ``benchmarks/`` is run by a test, in tiny shapes (the Triton interpreter where
it needs a GPU), so an API change breaks a test here, not a rare run on a lent device. The engine
benchmarks run in their engines' environments (tests/integrations/sglang and vllm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def run_script(*argv: str, env: dict[str, str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*argv], cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_every_benchmark_script_is_run_by_a_test() -> None:
    """Each script is run by a test, or by a shell script a test runs (cuda_session.sh runs
    cuda_session.py, which imports cuda_check.py)."""
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    run = {s for s in scripts if f'"benchmarks/{s}"' in tests}
    run |= {s for s in scripts for runner in run if runner.endswith(".sh") and s in (BENCHMARKS / runner).read_text()}
    assert scripts and [s for s in scripts if s not in run] == []


def test_cuda_check_runs_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    proc = run_script(sys.executable, "benchmarks/cuda_check.py", "--emulate", "--quick", env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and "all checks passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_spec_decode_runs_and_finds_mtp_lossless() -> None:
    proc = run_script(sys.executable, "benchmarks/spec_decode.py", "--max-new-tokens", "8", "--batch-sizes", "1", "--repeats", "1",
                      "--train-steps", "5", "--train-sequences", "8", "--no-cache", "--threads", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow  # two minutes of Triton interpreter on a 2-core machine
def test_cuda_session_rehearses_every_step_within_its_planned_seven_minutes(tmp_path: Path) -> None:
    """``benchmarks/cuda_session.sh`` on the CPU (Triton interpreter, tiny shapes, a tiny exported
    checkpoint): every step writes its JSON line and passes, and the limits it plans on a GPU add
    up to at most 7 minutes."""
    import json
    import re

    pytest.importorskip("triton")
    script = (BENCHMARKS / "cuda_session.sh").read_text()
    limits = [int(s) for s in re.findall(r"^step \w+ (\d+)$", script, flags=re.M)]
    assert len(limits) == 6 and sum(limits) <= 7 * 60, limits
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    export = run_script(sys.executable, "-m", "hal.tools.cli", "demo", "--train-steps", "5", "--train-sequences", "8",
                        "--max-new-tokens", "4", "--no-cache", "--export", str(tmp_path / "ckpt"))
    assert export.returncode == 0, export.stderr[-2000:]
    proc = run_script("bash", "benchmarks/cuda_session.sh", str(tmp_path / "out"), str(tmp_path / "ckpt"), "--rehearse", env=env)
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["environment", "correctness", "graphs", "mtp", "figures", "bench"], proc.stdout
    failed = {r["name"]: r["error"] for r in rows if not r["ok"]}
    assert not failed, (failed, proc.stdout[-3000:])
    assert rows[1]["figures"]["checks"] >= 20 and rows[3]["figures"]["accept length"] >= 1
