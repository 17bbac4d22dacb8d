"""The CPU backend: torch, and a small compiled kernel for decode-sized batches (``native``), ``hal
demo``'s default; held to ``hal.oracle`` like every backend."""

from __future__ import annotations

import torch

from hal.backends.cpu import native
from hal.backends.cpu.attention import CpuAttention
from hal.backends.cpu.graph import CpuGraph
from hal.backends.cpu.kv_pool import CpuKVPool
from hal.sdk import Availability, BackendBase


class CpuBackend(BackendBase):
    """Host memory, ``paged_attention`` (compiled or torch) and eager graphs; always available."""

    name = "cpu"
    device_type = "cpu"
    collective_backend = "gloo"
    auto_priority = 0  # the last resort of "auto"
    kv_pool_class = CpuKVPool
    attention_class = CpuAttention
    graph_class = CpuGraph
    host_memory = True

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, f"torch; compiled attention {native.native_status()}", device_count=1,
                            versions={"torch": torch.__version__})
