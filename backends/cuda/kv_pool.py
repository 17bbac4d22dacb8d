"""The CUDA backend's KV pool: hal's split-K/V layout in device memory."""

from __future__ import annotations

from hal.sdk import SplitKVPool


class CudaKVPool(SplitKVPool):
    """Split K/V pool in device memory; ``set_kv`` writes with one ``index_copy_`` per buffer
    (the ``SplitKVPool`` default), which reads no device values and so is graph-capturable."""
