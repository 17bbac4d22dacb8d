"""The CPU backend's KV pool: hal's split-K/V layout in host memory, written by wide-row ``index_copy_``."""

from __future__ import annotations

from hal.sdk import SplitKVPool


class CpuKVPool(SplitKVPool):
    """Split K/V pool in host memory; ``SplitKVPool``'s allocation and row writes as they are."""
