"""Process-wide choices for the whole suite, made once before any test module is collected, and
hypothesis profiles.

- Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``): ``@triton.jit`` reads it when a
  kernel module is imported, and transformers imports triton on its own, so whichever test ran
  first would otherwise decide whether the cuda backend's emulation can run at all. Tests of what
  happens without it start a clean subprocess.
- Each test leaves the process as it found it: the NPU emulator installed process-wide as
  ``torch_npu`` / ``torch.npu`` (``emulator.install()``, which only the emulator's own tests use:
  ``hal.get_backend("npu", emulate=True)`` installs nothing) is removed again after a test that
  installed it, and torch's thread count is restored, so no test passes or fails because of which
  tests ran before it (the suite runs in random order: pytest-randomly).

Hypothesis profiles:

- ``ci`` (chosen when the ``CI`` environment variable is set): derandomized, so a CI failure
  reproduces locally with ``CI=1``; no deadline (torch's first calls are slow and timing is
  not what the properties check).
- ``dev`` (default): random exploration with the example database, no deadline.
``HYPOTHESIS_PROFILE=<name>`` picks a profile explicitly.

Both keep hypothesis' usual 100 examples per test, so tests that do not ask for a budget are
not slowed down. hal's own properties ask for one of two named budgets on top of the loaded
profile (they inherit its deadline and derandomization):

    CHEAP = settings.get_profile("hal-cheap")          # pool / metadata / allocator properties
    EXPENSIVE = settings.get_profile("hal-expensive")  # attention and graph-runner properties
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def process_as_found() -> Iterator[None]:
    """Undo what a test changed process-wide (after the higher-scoped fixtures it uses have set up,
    so an emulator a module fixture installed stays for that module)."""
    import torch

    emulator_installed = "torch_npu" in sys.modules
    threads = torch.get_num_threads()
    yield
    if not emulator_installed and "torch_npu" in sys.modules:
        from hal.backends.npu import emulator

        emulator.uninstall()  # a no-op for anything but the emulator
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)

IN_CI = bool(os.environ.get("CI"))

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if IN_CI else "dev"))

settings.register_profile("hal-cheap", parent=settings.default, max_examples=300 if IN_CI else 60)
settings.register_profile("hal-expensive", parent=settings.default, max_examples=80 if IN_CI else 20)
