"""What the emulated torch_npu raises where the real op or runtime rejects a call."""

from __future__ import annotations


class NpuOpError(RuntimeError):
    """An emulated torch_npu call was given arguments the real op or runtime rejects."""


class CaptureSyncError(NpuOpError):
    """A host synchronisation (reading device data on the host) happened inside a graph capture."""


def fail(message: str) -> None:
    """Raise ``NpuOpError(message)``."""
    raise NpuOpError(message)
