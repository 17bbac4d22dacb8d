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
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    assert scripts and [s for s in scripts if f'"benchmarks/{s}"' not in tests] == []


def test_cuda_check_runs_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    proc = run_script(sys.executable, "benchmarks/cuda_check.py", "--emulate", "--quick", env={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and "all checks passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_spec_decode_runs_and_finds_mtp_lossless() -> None:
    proc = run_script(sys.executable, "benchmarks/spec_decode.py", "--max-new-tokens", "8", "--batch-sizes", "1", "--repeats", "1",
                      "--train-steps", "5", "--train-sequences", "8", "--no-cache", "--threads", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
