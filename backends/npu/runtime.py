"""The vendor runtime of one ``NpuBackend``: the only place hal.backends.npu reaches torch_npu.

An ``NpuRuntime`` holds the two handles the backend calls through, resolved once when the backend
is built: ``torch_npu`` (the ops) and ``npu`` (``torch.npu``: streams, synchronisation,
``NPUGraph``, ``graph(...)``). On Ascend they are the real modules (``ascend()``); emulated
(``hal.backends.npu.emulator.npu_runtime()``) they are the CPU emulator's namespaces, which nothing else in the process sees:
no ``sys.modules["torch_npu"]``, no ``torch.npu``, so every other library still sees the machine
it runs on. The backend's calls read ``runtime.torch_npu.<op>(...)`` / ``runtime.npu.<name>``
either way, and both namespaces carry exactly the names listed in ``TORCH_NPU_OPS`` and
``TORCH_NPU_RUNTIME`` (``tests/backends/npu/test_npu_runtime_surface.py`` holds the call sites
to these lists).

Importing this module imports nothing from Ascend.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import re
from typing import Any

import attrs
import torch

#: The torch_npu ops the backend calls (``runtime.torch_npu.<name>``).
TORCH_NPU_OPS = ("npu_fused_infer_attention_score_v2", "npu_scatter_nd_update_")
#: The ``torch.npu`` names the backend uses (``runtime.npu.<name>``).
TORCH_NPU_RUNTIME = (
    "NPUGraph", "graph", "graph_pool_handle", "synchronize", "Stream", "current_stream", "stream",
    "is_available", "device_count", "current_device", "set_device", "mem_get_info",
)  # fmt: skip


@attrs.frozen
class NpuRuntime:
    """The handles one backend calls its vendor runtime through (see the module doc)."""

    torch_npu: Any
    npu: Any
    emulated: bool

    def tensor_device(self, index: int | None) -> torch.device:
        """Where the backend's tensors live: ``npu:<index>`` on Ascend, the host when emulated."""
        if self.emulated:
            return torch.device("cpu")
        return torch.device("npu", self.npu.current_device() if index is None else index)

    @property
    def version(self) -> str:
        return str(getattr(self.torch_npu, "__version__", "unknown"))


def is_installed() -> bool:
    """Whether a real ``torch_npu`` can be imported; cheap, imports nothing."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ValueError, ImportError):  # a module in sys.modules without a spec, or a broken parent
        return False


@functools.cache
def ascend() -> NpuRuntime:
    """The real torch_npu and ``torch.npu`` (importing torch_npu registers ``torch.npu``)."""
    module = importlib.import_module("torch_npu")
    if getattr(module, "IS_HAL_EMULATOR", False):
        raise ImportError(
            "the torch_npu imported in this process is hal's CPU emulator (installed process-wide by a test); "
            "ask for the emulated backend instead: hal.get_backend('npu', emulate=True)"
        )
    npu = getattr(torch, "npu")  # noqa: B009 - torch.npu exists only once torch_npu is imported
    missing = [f"torch_npu.{n}" for n in TORCH_NPU_OPS if not hasattr(module, n)]
    missing += [f"torch.npu.{n}" for n in TORCH_NPU_RUNTIME if not hasattr(npu, n)]
    if missing:
        raise ImportError(f"torch_npu {getattr(module, '__version__', '?')} lacks what hal's npu backend calls: {', '.join(missing)}")
    return NpuRuntime(torch_npu=module, npu=npu, emulated=False)


# The oldest torch_npu the backend accepts: FIA v2 with TND + paged KV, sparse mode 4 and
# learnable_sink is missing from older releases of the op (an older revision of its documentation
# allows only sparse modes 0/3 and no paged attention in TND). The pyproject's npu extra says the same.
MIN_TORCH_NPU = (2, 8, 0)


def version_tuple(version: str) -> tuple[int, ...] | None:
    """``"2.8.0.post2"`` -> ``(2, 8, 0)``; None when the string does not start with a release number."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if m is None else tuple(int(g or 0) for g in m.groups())


def installed_version() -> str | None:
    """The installed torch_npu distribution's version, read from its metadata (imports nothing)."""
    for dist in ("torch_npu", "torch-npu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def too_old(version: str | None) -> str | None:
    """Why ``version`` is below ``MIN_TORCH_NPU`` (or unreadable), or None when it is recent enough."""
    floor = ".".join(map(str, MIN_TORCH_NPU))
    parsed = None if version is None else version_tuple(version)
    if parsed is None:
        return f"torch_npu version {version!r} cannot be read; hal needs torch_npu >= {floor}"
    if parsed < MIN_TORCH_NPU:
        return (
            f"torch_npu {version} is older than {floor}, the first hal supports (FIA v2 with TND, paged KV, "
            "sparse mode 4 and learnable_sink); pip install 'torch_npu>=" + floor + "' with a matching CANN"
        )
    return None
