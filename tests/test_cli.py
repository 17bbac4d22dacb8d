"""The ``hal`` command line: version, help without torch, lazy sub-commands, installed names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hal
from hal.tools.cli import COMMANDS

TORCH_PROBE = "import sys\n{body}\nprint('torch imported:', 'torch' in sys.modules)\n"


def _python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_version() -> None:
    proc = subprocess.run([sys.executable, "-m", "hal.tools.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"hal {hal.__version__}"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], *([c, "--help"] for c in COMMANDS)])
def test_help_and_version_import_no_torch(argv: list[str]) -> None:
    body = (
        "from hal.tools.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
    )
    proc = _python(TORCH_PROBE.format(body=body))
    assert proc.returncode == 0, proc.stderr
    assert "usage: hal" in proc.stdout or "hal " in proc.stdout
    assert proc.stdout.strip().endswith("torch imported: False"), proc.stdout


def test_import_hal_imports_no_torch_until_a_name_is_used() -> None:
    proc = _python(TORCH_PROBE.format(body="import hal\nassert hal.__version__"))
    assert proc.stdout.strip() == "torch imported: False", proc.stderr
    proc = _python(TORCH_PROBE.format(body="import hal\nassert hal.get_backend('cpu').name == 'cpu'"))
    assert proc.stdout.strip() == "torch imported: True", proc.stderr


def test_public_api_names_resolve() -> None:
    for name in hal.__all__:
        assert getattr(hal, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hal.nope  # noqa: B018
    assert set(hal.__all__) <= set(dir(hal))


def test_installed_names_live_under_hal_only(tmp_path: Path) -> None:
    code = (
        "import importlib.util, hal, hal.backends.npu, hal.backends.cuda, hal.speculative, hal.tools.conformance\n"
        "print([importlib.util.find_spec(n) is None for n in ('backends', 'speculative')])\n"
        "print(hal.backends.npu.NpuBackend.__module__, hal.speculative.MultiLayerEagleWorker.__module__)\n"
    )
    proc = _python(code, cwd=tmp_path)  # outside the repository: only what is installed
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[True, True]", "hal.backends.npu hal.speculative.mtp"]
    fail = _python("import backends", cwd=tmp_path)
    assert fail.returncode != 0 and "No module named 'backends'" in fail.stderr
