"""The CPU reference backend: pure torch, the conformance oracle and ``hal demo``'s default."""

from __future__ import annotations

import torch

from backends.cpu.attention import CpuAttention, paged_attention
from backends.cpu.graph import EagerGraph
from hal.kv_pool import SplitKVPool
from hal.protocols import Availability
from hal.spec import KVPoolSpec


class CpuKVPool(SplitKVPool):
    """Split K/V pool in host memory; writes by ``index_copy_``."""


class CpuBackend:
    name = "cpu"
    device_type = "cpu"
    collective_backend = "gloo"

    def __init__(self, index: int | None = None) -> None:
        self.device = torch.device("cpu")

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, "pure torch", device_count=1, versions={"torch": torch.__version__})

    @classmethod
    def is_available(cls) -> bool:
        return True

    def create_kv_pool(self, spec: KVPoolSpec) -> CpuKVPool:
        return CpuKVPool(spec, self.device)

    def create_attention(self, pool: CpuKVPool) -> CpuAttention:
        return CpuAttention(pool)

    def create_graph(self) -> EagerGraph:
        return EagerGraph()

    def graph_memory_pool(self) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"CpuBackend(device={self.device})"


__all__ = ["CpuAttention", "CpuBackend", "CpuKVPool", "EagerGraph", "paged_attention"]
