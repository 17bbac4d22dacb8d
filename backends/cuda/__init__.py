"""The CUDA backend: Triton paged attention, ``torch.cuda.CUDAGraph``, indexed-copy KV writes.

Importing this module does not import triton; the kernel module is imported on the first
attention call. ``hal.get_backend("cuda", emulate=True)`` builds a backend whose tensors live on the
host and whose kernels run in the Triton CPU interpreter. That one switch is process-wide
(``TRITON_INTERPRET=1`` before triton is imported): Triton decides at its own import whether its
standard library (the combine functions of ``tl.max``...) is compiled or interpreted, and an
interpreted kernel cannot call a compiled one, so interpretation cannot be scoped to one backend.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from typing import Any

import torch

from hal.backends.cuda.attention import CudaAttention
from hal.backends.cuda.graph import CudaGraph
from hal.backends.cuda.kv_pool import CudaKVPool
from hal.sdk import Availability, BackendBase, BackendUnavailableError, EagerGraph, GraphBase, host_memory_bytes

_INTERPRET_ENV = "TRITON_INTERPRET"


def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _interpreter_blocked() -> str | None:
    """Why the Triton interpreter can no longer be switched on in this process, or None."""
    if os.environ.get(_INTERPRET_ENV) != "1" and ("triton" in sys.modules or "hal.backends.cuda.triton_attention" in sys.modules):
        return (
            f"cuda emulation must start before triton is imported, but triton is already imported with "
            f"{_INTERPRET_ENV}={os.environ.get(_INTERPRET_ENV)!r}; set {_INTERPRET_ENV}=1 in the environment "
            "or call hal.get_backend('cuda', emulate=True) before anything imports triton"
        )
    return None


def interpret_triton() -> None:
    """Switch Triton to its CPU interpreter (process-wide; see the module doc)."""
    blocked = _interpreter_blocked()
    if blocked is not None:
        raise BackendUnavailableError(blocked)
    os.environ[_INTERPRET_ENV] = "1"


class CudaBackend(BackendBase):
    """NVIDIA GPUs through Triton and CUDA graphs (NCCL for collectives).

    Under emulation the device is the CPU, kernels run in the Triton interpreter, and
    ``create_graph()`` returns an ``EagerGraph``: there is no CUDA runtime to capture with, so
    replays re-run the captured function on the same static buffers, which is what a CUDA graph
    replay feeds its kernels too (stale host values included).
    """

    name = "cuda"
    device_type = "cuda"
    collective_backend = "nccl"
    auto_priority = 200
    preferred_dtype = torch.bfloat16
    kv_dtype_preference = (torch.bfloat16, torch.float16, torch.float32)
    kv_pool_class = CudaKVPool
    attention_class = CudaAttention
    graph_class = CudaGraph
    captures_graphs = True

    def __init__(self, index: int | None = None, *, emulated: bool = False) -> None:
        if emulated:
            interpret_triton()
        super().__init__(index, emulated=emulated)

    def _tensor_device(self, index: int | None) -> torch.device:
        if self.emulated:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def memory_bytes(self) -> int | None:
        """The GPU's total memory (the host's under emulation)."""
        if self.device.type == "cuda":
            return int(torch.cuda.get_device_properties(self.device).total_memory)
        return host_memory_bytes()  # emulated: the tensors live on the host

    @classmethod
    def probe(cls) -> Availability:
        triton_version = _triton_version()
        versions: dict[str, str] = {"torch": str(torch.__version__)}
        if triton_version is not None:
            versions["triton"] = triton_version
        missing = []
        count = 0
        if torch.version.cuda is None:
            missing.append(f"torch {torch.__version__} is built without CUDA (torch.version.cuda is None)")
        else:
            versions["cuda"] = torch.version.cuda
            count = torch.cuda.device_count()
            if count == 0:
                missing.append("no CUDA device is visible (torch.cuda.device_count() == 0)")
        if triton_version is None:
            missing.append("triton is not installed")
        if missing:
            return Availability(False, "; ".join(missing), device_count=count, versions=versions)
        return Availability(True, torch.cuda.get_device_name(0), device_count=count, versions=versions)

    @classmethod
    def probe_emulation(cls) -> Availability:
        """The Triton CPU interpreter on host tensors, with eager graphs (needs triton installed, and
        triton not yet imported without ``TRITON_INTERPRET=1``)."""
        versions: dict[str, str] = {"torch": str(torch.__version__)}
        triton_version = _triton_version()
        if triton_version is None:
            return Availability(False, "cuda emulation needs triton (pip install '.[cuda]'): it is not installed")
        versions["triton"] = triton_version
        blocked = _interpreter_blocked()
        if blocked is not None:
            return Availability(False, blocked, versions=versions)
        return Availability(True, f"emulated: Triton interpreter on CPU tensors ({_INTERPRET_ENV}=1), eager graphs",
                            device_count=1, versions=versions)

    def create_graph(self, *, tp_group: Any = None) -> GraphBase:
        return EagerGraph(tp_group=tp_group) if self.emulated else CudaGraph(self.device, tp_group=tp_group)

    def graph_memory_pool(self) -> Any:
        """A fresh CUDA graph memory pool handle; one runner shares it across its batch sizes."""
        return None if self.emulated else torch.cuda.graph_pool_handle()

    def synchronize(self) -> None:
        if not self.emulated:
            torch.cuda.synchronize(self.device)
