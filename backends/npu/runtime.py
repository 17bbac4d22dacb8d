"""Lazy access to torch_npu and ``torch.npu``: the only place hal.backends.npu imports the vendor runtime.

Importing this module imports nothing from Ascend; every accessor imports ``torch_npu`` on first
use (the real one, or the emulator once ``hal.backends.npu.emulator.install()`` has run).
"""

from __future__ import annotations

import importlib
import importlib.util
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
