"""The Ascend NPU backend: FIA v2 paged attention, NPUGraph capture with host-parameter updates,
split K/V pools written by ``npu_scatter_nd_update_``.

``torch_npu`` is imported when a backend is built (``hal.backends.npu.runtime``), never at import
time. Without Ascend hardware, ``hal.get_backend("npu", emulate=True)`` builds the backend on the CPU
emulator in ``hal.backends.npu.emulator``, reached through that backend's runtime handles only:
nothing is installed in the process.
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
from hal.sdk import Availability, BackendBase

# Device nodes the Ascend driver creates, one per NPU: counted without importing torch_npu.
DEVICE_NODES = "/dev/davinci[0-9]*"


def _emulated_runtime() -> runtime.NpuRuntime:
    from hal.backends.npu import emulator  # imported only when asked for: it registers its op library

    return emulator.npu_runtime()


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

    def __init__(self, index: int | None = None, *, emulated: bool = False) -> None:
        #: torch_npu and torch.npu as this backend calls them: Ascend's, or the emulator's.
        self.runtime = _emulated_runtime() if emulated else runtime.ascend()
        super().__init__(index, emulated=emulated)
        self._graph_pool: Any = None
        self._capture_stream: Any = None

    def _tensor_device(self, index: int | None) -> torch.device:
        return self.runtime.tensor_device(index)

    def memory_bytes(self) -> int | None:
        """The NPU's total memory (``torch.npu.mem_get_info``; the host's under the emulator)."""
        return int(self.runtime.npu.mem_get_info(self.device)[1])

    def kv_pool_options(self) -> dict[str, Any]:
        return {"runtime": self.runtime}

    @classmethod
    def probe(cls) -> Availability:
        """Cheap: asks ``torch.npu`` only once torch_npu is imported; before that, counts the
        driver's device nodes (importing torch_npu initialises the runtime: seconds, not a probe)."""
        if not runtime.is_installed():
            return Availability(False, "torch_npu is not installed")
        imported = sys.modules.get("torch_npu")
        if imported is not None and getattr(imported, "IS_HAL_EMULATOR", False):
            return Availability(False, "the torch_npu in this process is hal's CPU emulator: use hal.get_backend('npu', emulate=True)")
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
            ascend = runtime.ascend()
        except Exception as exc:  # noqa: BLE001 - a broken install is "unavailable", with the reason
            return Availability(False, f"torch_npu failed to import: {type(exc).__name__}: {exc}")
        versions = {"torch": torch.__version__, "torch_npu": ascend.version}
        if not ascend.npu.is_available():
            return Availability(False, "torch_npu is installed but no NPU is available", 0, versions)
        return Availability(True, f"Ascend NPU via torch_npu, {int(ascend.npu.device_count())} device(s)",
                            int(ascend.npu.device_count()), versions)

    @classmethod
    def probe_emulation(cls) -> Availability:
        """The CPU emulator of torch_npu (``hal.backends.npu.emulator``), held by the backend alone."""
        emulated = _emulated_runtime()
        count = int(emulated.npu.device_count())
        return Availability(True, f"torch_npu CPU emulator (hal.backends.npu.emulator), {count} device(s), "
                            "scoped to this backend", count, {"torch": torch.__version__, "torch_npu": emulated.version})

    def create_graph(self, *, tp_group: Any = None) -> NpuGraph:
        if self._capture_stream is None:
            self._capture_stream = self.runtime.npu.Stream(device=self.device)
        return NpuGraph(self.runtime, stream=self._capture_stream, tp_group=tp_group)

    def graph_memory_pool(self) -> Any:
        """One memory pool shared by every graph of this backend."""
        if self._graph_pool is None:
            self._graph_pool = self.runtime.npu.graph_pool_handle()
        return self._graph_pool

    def synchronize(self) -> None:
        self.runtime.npu.synchronize()
