"""The README's Python examples run as written (those that need SGLang run in its own test site)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("code", [b for b in BLOCKS if "sglang" not in b], ids=lambda code: code.splitlines()[0][:40])
def test_readme_python_example_runs(code: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_there_are_examples_to_run() -> None:
    assert len([b for b in BLOCKS if "sglang" not in b]) >= 2
