"""The Ascend NPU backend: FIA v2 paged attention, NPUGraph capture with host-parameter updates,
split K/V pools written by ``npu_scatter_nd_update_``.

``torch_npu`` is imported lazily, on first use (see ``hal.backends.npu.runtime``), never at import time.
Without Ascend hardware the backend runs on the CPU emulator in ``hal.backends.npu.emulator``, installed
only on request: ``hal.get_backend("npu", emulate=True)`` or ``NpuBackend.install_emulation()``.
"""

from __future__ import annotations

import glob
import sys
from typing import Any

import torch

from hal.backends.npu import runtime
from hal.backends.npu.attention import NpuAttention
from hal.backends.npu.graph import NpuGraph
from hal.backends.npu.kv_pool import NpuKVPool
from hal.sdk import Availability, BackendBase, host_memory_bytes

# Device nodes the Ascend driver creates, one per NPU: counted without importing torch_npu.
DEVICE_NODES = "/dev/davinci[0-9]*"


class NpuBackend(BackendBase):
    """Backend bundle for ``"npu"`` / ``"npu:<index>"``.

    Pages of 128 tokens by default: the FIA v2 documentation's block_size rules for multi-token
    queries disagree between sections (a multiple of 128 in 128..512, or 16-aligned up to 1024 in
    TND), and 128 satisfies every reading for every head dim and mode.
    """

    name = "npu"
    device_type = "npu"
    collective_backend = "hccl"
    auto_priority = 300
    default_page_size = 128
    preferred_dtype = torch.bfloat16
    kv_dtype_preference = (torch.bfloat16, torch.float16, torch.float32)
    kv_pool_class = NpuKVPool
    attention_class = NpuAttention
    graph_class = NpuGraph
    captures_graphs = True

    def __init__(self, index: int | None = None) -> None:
        super().__init__(index)
        self._graph_pool: Any = None
        self._capture_stream: Any = None

    def _tensor_device(self, index: int | None) -> torch.device:
        return runtime.tensor_device(index)

    def memory_bytes(self) -> int | None:
        """The NPU's total memory (``torch.npu.mem_get_info``; the host's under the emulator)."""
        if self.device.type == "npu":
            return int(runtime.npu().mem_get_info(self.device)[1])
        return host_memory_bytes()  # emulated: the tensors live on the host

    @classmethod
    def probe(cls) -> Availability:
        """Cheap: asks ``torch.npu`` only once torch_npu is imported; before that, counts the
        driver's device nodes (importing torch_npu initialises the runtime: seconds, not a probe)."""
        if not runtime.is_installed():
            return Availability(False, "torch_npu is not installed")
        imported = sys.modules.get("torch_npu")
        if imported is None or not getattr(imported, "IS_HAL_EMULATOR", False):
            version = runtime.installed_version() if imported is None else getattr(imported, "__version__", None)
            reason = runtime.too_old(None if version is None else str(version))
            if reason is not None:
                return Availability(False, reason)
        if imported is None:
            nodes = len(glob.glob(DEVICE_NODES))
            if nodes == 0:
                return Availability(False, f"torch_npu is installed but no Ascend device node ({DEVICE_NODES}) exists")
            return Availability(True, f"Ascend NPU, {nodes} device node(s); torch_npu is imported on first use", nodes)
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
    def install_emulation(cls) -> None:
        """Install the CPU stand-in for torch_npu (explicit only; see hal.backends.npu.emulator)."""
        from hal.backends.npu import emulator

        emulator.install()

    def create_graph(self, *, tp_group: Any = None) -> NpuGraph:
        if self._capture_stream is None:
            self._capture_stream = runtime.npu().Stream(device=self.device)
        return NpuGraph(stream=self._capture_stream, tp_group=tp_group)

    def graph_memory_pool(self) -> Any:
        """One memory pool shared by every graph of this backend."""
        if self._graph_pool is None:
            self._graph_pool = runtime.npu().graph_pool_handle()
        return self._graph_pool

    def synchronize(self) -> None:
        runtime.npu().synchronize()

    def __repr__(self) -> str:
        return f"NpuBackend(device={self.device}{', emulated' if runtime.is_emulated() else ''})"
