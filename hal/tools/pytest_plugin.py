"""pytest plugin: run hal's conformance suite against any registered backend.

    pytest --hal-device=npu --hal-emulate            # every check, one test item each
    pytest --hal-device=mydev --hal-quick -k "graph"  # a covering subset, then pytest's own -k

Registered through the ``pytest11`` entry point, so installing hal makes the options available.
Without ``--hal-device`` it adds no items and resolves no backend.
Checks the backend declines with ``UnsupportedConfigError`` are skipped with reason
"unsupported: ..."; the per-feature table is printed at the end of the run. The fixture
``hal_backend`` gives a project's own tests the backend under test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from hal.tools.conformance import Check, CheckResult
    from hal.protocols import Backend

_RESULTS_KEY = pytest.StashKey[list["CheckResult"]]()
_BACKEND_KEY = pytest.StashKey["Backend"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hal", "hal backend conformance")
    group.addoption("--hal-device", default=None, metavar="DEVICE",
                    help="run hal's conformance suite against this backend (e.g. cpu, npu, cuda:0, mydev)")
    group.addoption("--hal-emulate", action="store_true", default=False,
                    help="build the backend on its CPU emulator (emulate=True)")
    group.addoption("--hal-quick", action="store_true", default=False,
                    help="the quick conformance suite: every feature, fewer shapes")


def _backend(config: pytest.Config) -> Backend:
    if _BACKEND_KEY not in config.stash:
        import hal
        from hal.errors import HalError

        device = config.getoption("hal_device")
        try:
            config.stash[_BACKEND_KEY] = hal.get_backend(device, emulate=config.getoption("hal_emulate"))
        except HalError as exc:
            raise pytest.UsageError(f"--hal-device={device}: {type(exc).__name__}: {exc}") from exc
    return config.stash[_BACKEND_KEY]


class ConformanceItem(pytest.Item):
    """One conformance check as a test item."""

    def __init__(self, *, check: Check, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check
        for feature in check.features:
            self.add_marker(pytest.mark.hal_conformance(feature))

    def runtest(self) -> None:
        from hal.tools.conformance import ConformanceFailure, Status, run_check

        result = run_check(_backend(self.config), self.check)
        self.config.stash.setdefault(_RESULTS_KEY, []).append(result)
        if result.status is Status.UNSUPPORTED:
            pytest.skip(f"unsupported: {result.detail}")
        if result.status is Status.FAILED:
            raise ConformanceFailure(result.detail)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        from hal.tools.conformance import ConformanceFailure

        if isinstance(excinfo.value, ConformanceFailure):
            return f"{self.check.name}: {excinfo.value}"
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        return "hal-conformance", None, self.name


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hal_conformance(feature): a hal conformance check exercising feature")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -k / -m deselection, so those apply to our items
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    device = config.getoption("hal_device")
    if not device:
        return
    from hal.tools.conformance import build_suite

    _backend(config)  # fail fast, with one line, on an unknown or unavailable device
    prefix = f"hal-conformance[{device}{'-emulated' if config.getoption('hal_emulate') else ''}]"
    items.extend(
        ConformanceItem.from_parent(session, name=f"{prefix}::{check.name}", check=check)
        for check in build_suite(quick=config.getoption("hal_quick"))
    )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS_KEY, None)
    if not results:
        return
    from hal.tools.conformance import format_table

    backend = _backend(config)
    terminalreporter.section(f"hal conformance: {backend.name} on {backend.device}")
    terminalreporter.write_line(format_table(results))


@pytest.fixture
def hal_backend(request: pytest.FixtureRequest) -> Backend:
    """The backend named by ``--hal-device`` (the test is skipped without it)."""
    if not request.config.getoption("hal_device"):
        pytest.skip("no --hal-device given")
    return _backend(request.config)
