"""An out-of-tree backend (tests/oot_backend) passes the kit with no change to hal/ or speculative/,
registered programmatically and through the ``hal.backends`` entry point of its distribution;
the pytest plugin runs the same suite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

import hal
from hal.tools.conformance import Status, build_suite, run_suite

REPO = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "oot_backend" / "site"


@pytest.fixture
def oot_registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.syspath_prepend(str(SITE))
    hal.register_backend("oot", "hal_oot_example:OotBackend", override=True)
    yield "oot"
    hal.unregister_backend("oot")


def _env(*extra_paths: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(p) for p in extra_paths] + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # load exactly the plugins a test names
    env.pop("PYTEST_ADDOPTS", None)  # and none of this run's options (its test-order seed)
    return env


def test_programmatically_registered_oot_backend_passes_the_full_suite(oot_registered: str) -> None:
    backend = hal.get_backend(oot_registered)
    assert type(backend).__module__ == "hal_oot_example.backend"
    results = run_suite(backend, build_suite())
    bad = [(r.check.name, r.status.value, r.detail) for r in results if r.status is not Status.PASSED]
    assert not bad


def test_oot_graph_without_host_parameter_updates_is_caught(oot_registered: str) -> None:
    """The example's graph bakes host lengths at capture; dropping the update must fail the loops."""
    from hal_oot_example import OotBackend, ReplayGraph

    from hal.graph import GraphUpdate

    class ForgetsHostParams(ReplayGraph):
        def replay(self, update: GraphUpdate | None = None) -> None:
            super().replay(None if update is None else GraphUpdate(buffer_copies=update.buffer_copies))

    class Stale(OotBackend):
        def create_graph(self, *, tp_group: object = None) -> ReplayGraph:
            return ForgetsHostParams()

    results = run_suite(Stale(), build_suite(quick=True, select=["graph loop"]))
    assert results and all(r.status is Status.FAILED for r in results), [(r.check.name, r.status) for r in results]
    assert all("replayed graph vs eager" in r.detail for r in results)


def test_entry_point_discovery_and_cli_in_a_fresh_process() -> None:
    env = _env(SITE)
    info = subprocess.run([sys.executable, "-m", "hal.tools.cli", "info"], env=env, capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    row = next(line for line in info.stdout.splitlines() if line.startswith("oot "))
    assert "entry point (hal-oot-example)" in row and row.split()[1] == "yes"
    conf = subprocess.run(
        [sys.executable, "-m", "hal.tools.cli", "conformance", "--device", "oot", "--quick"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert conf.returncode == 0, conf.stdout + conf.stderr
    assert "| **total" in conf.stdout and " 0 failed" in conf.stdout


def _write_broken_distribution(root: Path) -> Path:
    """A tiny installed-looking distribution whose backend writes V one slot off."""
    site = root / "site"
    (site / "broken_backend_dist-0.1.dist-info").mkdir(parents=True)
    (site / "broken_backend_dist-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-backend-dist\nVersion: 0.1\n")
    (site / "broken_backend_dist-0.1.dist-info" / "entry_points.txt").write_text("[hal.backends]\nbrokenv = broken_backend:Backend\n")
    (site / "broken_backend.py").write_text(textwrap.dedent('''
        from hal.backends.cpu import CpuBackend
        from hal.backends.cpu.kv_pool import CpuKVPool
        from hal.errors import UnsupportedConfigError

        class Pool(CpuKVPool):
            def _write_rows(self, buffer, loc, rows):
                if rows.shape[-1] != self.spec.head_dim:
                    loc = (loc + 1) % buffer.shape[0]
                super()._write_rows(buffer, loc, rows)

        class Backend(CpuBackend):
            name = "brokenv"
            def create_kv_pool(self, spec):
                return Pool(spec, self.device)
            def create_graph(self, *, tp_group=None):
                raise UnsupportedConfigError("no graphs on this device")
    '''))
    return site


def test_pytest_plugin_runs_the_suite_on_the_oot_backend(tmp_path: Path) -> None:
    (tmp_path / "test_own.py").write_text("def test_own(hal_backend):\n    assert hal_backend.name == 'oot'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "hal.tools.pytest_plugin", "--hal-device=oot", "--hal-quick", "-q",
         "-p", "no:cacheprovider", str(tmp_path)],
        env=_env(SITE), cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    expected = len(build_suite(quick=True)) + 1
    assert f"{expected} passed" in proc.stdout
    assert "hal conformance: oot on cpu" in proc.stdout and "| kv pool: round trip" in proc.stdout


def test_pytest_plugin_fails_broken_and_skips_unsupported(tmp_path: Path) -> None:
    site = _write_broken_distribution(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "hal.tools.pytest_plugin", "--hal-device=brokenv", "--hal-quick",
         "-k", "round or graph", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        env=_env(site), cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "kv pool round trip [fp32 d24/16 ps4]: layer 0: V read back" in proc.stdout
    assert "2 failed, 1 passed, 6 skipped" in proc.stdout  # the runner contract holds: it makes no graph
    assert "unsupported: no graphs on this device" in proc.stdout


def test_pytest_plugin_reports_an_unknown_device_as_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "hal.tools.pytest_plugin", "--hal-device=nosuchdev", "-q",
         "-p", "no:cacheprovider", str(tmp_path)],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 4  # pytest's usage-error exit code
    assert "UnknownDeviceError" in proc.stderr and "nosuchdev" in proc.stderr


def test_plugin_is_registered_as_a_pytest11_entry_point() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"]["hal"] == "hal.tools.pytest_plugin"
