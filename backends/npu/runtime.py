"""Lazy access to torch_npu and ``torch.npu``: the only place hal.backends.npu imports the vendor runtime.

Importing this module imports nothing from Ascend; every accessor imports ``torch_npu`` on first
use (the real one, or the emulator once ``hal.backends.npu.emulator.install()`` has run).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from types import ModuleType

import torch


def is_installed() -> bool:
    """Whether a ``torch_npu`` (real or emulated) can be imported; cheap, imports nothing."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ValueError, ImportError):  # a module in sys.modules without a spec, or a broken parent
        return False


def torch_npu() -> ModuleType:
    """The ``torch_npu`` module (importing it registers ``torch.npu``)."""
    return importlib.import_module("torch_npu")


def npu() -> ModuleType:
    """``torch.npu`` (streams, synchronize, NPUGraph, graph(...))."""
    torch_npu()
    return getattr(torch, "npu")  # noqa: B009 - torch.npu exists only once torch_npu is imported


def is_emulated() -> bool:
    """True when the imported ``torch_npu`` is the CPU emulator."""
    return bool(getattr(torch_npu(), "IS_HAL_EMULATOR", False))


def tensor_device(index: int | None) -> torch.device:
    """Where this backend's tensors live: ``npu:<index>`` on Ascend, the host under the emulator."""
    if is_emulated():
        return torch.device("cpu")
    return torch.device("npu", npu().current_device() if index is None else index)


# The oldest torch_npu the backend accepts: FIA v2 with TND + paged KV, sparse mode 4 and
# learnable_sink is missing from older releases of the op (an older revision of its documentation
# allows only sparse modes 0/3 and no paged attention in TND). The pyproject's npu extra says the same.
MIN_TORCH_NPU = (2, 8, 0)


def version_tuple(version: str) -> tuple[int, ...] | None:
    """``"2.8.0.post2"`` -> ``(2, 8, 0)``; None when the string does not start with a release number."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if m is None else tuple(int(g or 0) for g in m.groups())


def installed_version() -> str | None:
    """The installed torch_npu distribution's version, read from its metadata (imports nothing)."""
    for dist in ("torch_npu", "torch-npu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def too_old(version: str | None) -> str | None:
    """Why ``version`` is below ``MIN_TORCH_NPU`` (or unreadable), or None when it is recent enough."""
    floor = ".".join(map(str, MIN_TORCH_NPU))
    parsed = None if version is None else version_tuple(version)
    if parsed is None:
        return f"torch_npu version {version!r} cannot be read; hal needs torch_npu >= {floor}"
    if parsed < MIN_TORCH_NPU:
        return (
            f"torch_npu {version} is older than {floor}, the first hal supports (FIA v2 with TND, paged KV, "
            "sparse mode 4 and learnable_sink); pip install 'torch_npu>=" + floor + "' with a matching CANN"
        )
    return None
