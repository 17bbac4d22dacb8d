"""The Ascend NPU backend: FIA v2 paged attention, NPUGraph capture with host-parameter updates,
split K/V pools written by ``npu_scatter_nd_update_``.

``torch_npu`` is imported lazily, on first use (see ``backends.npu.runtime``), never at import time.
Without Ascend hardware the backend runs on the CPU emulator in ``backends.npu.emulator``, installed
only on request: ``hal.get_backend("npu", emulate=True)`` or ``NpuBackend.install_emulation()``.
"""

from __future__ import annotations

from typing import Any

import torch

from backends.npu import runtime
from backends.npu.attention import NpuAttention
from backends.npu.graph import NpuGraph
from backends.npu.kv_pool import NpuKVPool
from hal.protocols import Availability
from hal.spec import KVPoolSpec


class NpuBackend:
    """Backend bundle for ``"npu"`` / ``"npu:<index>"``."""

    name = "npu"
    device_type = "npu"
    collective_backend = "hccl"

    def __init__(self, index: int | None = None, *, tp_group: Any = None) -> None:
        self.index = index
        self.device = runtime.tensor_device(index)
        self.tp_group = tp_group  # graphs barrier on it between warm-up and capture
        self._graph_pool: Any = None
        self._capture_stream: Any = None

    @classmethod
    def probe(cls) -> Availability:
        if not runtime.is_installed():
            return Availability(False, "torch_npu is not installed")
        try:
            torch_npu = runtime.torch_npu()
            npu = runtime.npu()
        except Exception as exc:  # noqa: BLE001 - a broken install is "unavailable", with the reason
            return Availability(False, f"torch_npu failed to import: {type(exc).__name__}: {exc}")
        versions = {"torch": torch.__version__, "torch_npu": str(getattr(torch_npu, "__version__", "unknown"))}
        if not npu.is_available():
            return Availability(False, "torch_npu is installed but no NPU is available", 0, versions)
        count = int(npu.device_count())
        what = "torch_npu CPU emulator" if runtime.is_emulated() else "Ascend NPU via torch_npu"
        return Availability(True, f"{what}, {count} device(s)", count, versions)

    @classmethod
    def is_available(cls) -> bool:
        return cls.probe().available

    @classmethod
    def install_emulation(cls) -> None:
        """Install the CPU stand-in for torch_npu (explicit only; see backends.npu.emulator)."""
        from backends.npu import emulator

        emulator.install()

    def create_kv_pool(self, spec: KVPoolSpec) -> NpuKVPool:
        return NpuKVPool(spec, self.device)

    def create_attention(self, pool: NpuKVPool) -> NpuAttention:
        return NpuAttention(pool)

    def create_graph(self) -> NpuGraph:
        if self._capture_stream is None:
            self._capture_stream = runtime.npu().Stream(device=self.device)
        return NpuGraph(stream=self._capture_stream, tp_group=self.tp_group)

    def graph_memory_pool(self) -> Any:
        """One memory pool shared by every graph of this backend."""
        if self._graph_pool is None:
            self._graph_pool = runtime.npu().graph_pool_handle()
        return self._graph_pool

    def synchronize(self) -> None:
        runtime.npu().synchronize()

    def __repr__(self) -> str:
        return f"NpuBackend(device={self.device}{', emulated' if runtime.is_emulated() else ''})"


__all__ = ["NpuAttention", "NpuBackend", "NpuGraph", "NpuKVPool"]
