"""The SGLang adapter tests: they need SGLang 0.5.23 installed as ``.ci/sglang`` installs it.

Without SGLang each module skips itself (``pytest.importorskip``): the main suite runs without it. With it, this file
puts ``site/`` (the placeholder ``sgl_kernel`` and the torchvision start-up fix) on the path of
this process and of every process SGLang starts, and records placeholder calls in a file that
``sgl_kernel_calls`` reads: a test that runs SGLang asserts that nothing called a placeholder.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SITE = Path(__file__).resolve().parent / "site"

if importlib.util.find_spec("sglang") is not None:
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's CPU path (its is_cpu())
    if str(SITE) not in sys.path:
        sys.path.insert(0, str(SITE))
        import sitecustomize  # noqa: F401  (this process started before site/ was on its path)


def pytest_report_header() -> str:
    if importlib.util.find_spec("sglang") is None:
        return "tests/integrations/sglang: skipped, SGLang is not installed (bash .ci/sglang installs it)"
    import sglang

    return f"tests/integrations/sglang: SGLang {sglang.__version__}"


@pytest.fixture(autouse=True)
def no_triton_interpreter_in_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's processes start as on a user's CPU machine: without the Triton interpreter the
    suite sets for the cuda backend's emulation (a Triton kernel SGLang launches there must fail
    as it would for the user, not run interpreted)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def sgl_kernel_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file the placeholder ``sgl_kernel`` appends a line to whenever one of its names is called."""
    calls = tmp_path / "sgl_kernel_calls.txt"
    monkeypatch.setenv("HAL_SGL_KERNEL_CALLS", str(calls))
    return calls
