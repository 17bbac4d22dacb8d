"""A strict, pure-torch CPU stand-in for the torch_npu surface ``hal.backends.npu`` uses.

``npu_runtime()`` hands an ``NpuRuntime`` over the emulator's ``torch_npu`` and ``torch.npu`` namespaces
to the backend that asked (``hal.get_backend("npu", emulate=True)``); nothing is installed in the
process, so SGLang, transformers and every other library still see a CPU machine. ``install()``
(tests only: what a process with a real torch_npu looks like) puts the same namespaces into
``sys.modules`` and at ``torch.npu``; ``uninstall()`` reverts both.

What it provides (and nothing more):

* ``torch_npu.npu_fused_infer_attention_score_v2`` (FIA v2), a ``torch.library`` op so graph capture
  sees it as one call with its host list arguments. It **rejects what the real op rejects**
  (the errors the torch_npu op-plugin documentation and the CANN checkers list) with :class:`NpuOpError`, and computes the documented
  result (masks, sparse modes and learnable sinks as documented) for the TND layout with a paged KV cache, the form the backend uses. Other
  layouts, rope, pse, quantisation and NZ caches pass the checks but raise ``NotImplementedError``.
* ``torch_npu.npu_scatter_nd_update_`` (in place), with its shape/dtype rules.
* ``torch.npu``: ``NPUGraph``, ``graph(...)``, ``graph_pool_handle``, ``synchronize``, ``Stream``,
  ``current_stream``, ``stream``, ``is_available``, ``device_count``, ``current_device``.

The NPUGraph stand-in records every aten op run during capture (a ``TorchDispatchMode``) and replays
that op list into the same output tensors: view ops are skipped (their outputs already alias), ops
that write their arguments are re-run, functional results are copied into the recorded outputs. So
device buffers are read at replay time while host arguments stay baked at capture-time values unless
``update()`` replaces them -- the real hazard. With ``auto_dispatch_capture=True`` each FIA call is a
*handled* op: like the real ``ExternalEvent``, replay waits at it until ``update()`` has re-issued it,
so a replay without an update fails instead of hanging as the device would.

Strictness beyond "compute the right numbers":

* a host synchronisation inside capture (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``,
  ``bool(tensor)``, data-dependent output shapes such as ``nonzero``) raises :class:`CaptureSyncError`
  ("Not allow to synchronize captured-stream"), as the runtime does;
* ``update()`` while a previous replay of the graph has not been synchronised raises
  :class:`NpuOpError` (on the device the update would rewrite the parameters of tasks still running);
* ``update()`` re-validates every re-issued op with its new host arguments, as the real re-issue does;
  a failed re-issue keeps the op's previous arguments and aborts the waiting replay.

Decisions on the points the spec marks [UNCONFIRMED] (all on the strict side):

* TND ``actual_seq_qlen[-1]`` must equal ``T`` (the query's first dim).
* TND with ``sparse_mode=3`` needs ``q_len <= kv_len`` per request (the older doc's rule); sparse
  modes allowed in TND are 0 (no mask), 3 and 4.
* The 2048x2048 template mask must be exactly ``triu(ones, diagonal=1)`` (True = masked).
* qk head dim != v head dim with paged attention is accepted (A2/A3 behaviour that sglang's MiMo-V2
  path relies on), in sparse modes 3 and 4; the TND head-dim rule (128/128, 192/128, 192/192) applies.
* ``learnable_sink`` counts in the returned ``softmax_lse``; fully masked rows give output 0 and
  ``lse = +inf`` (the CANN golden; the hardware may differ when ``inner_precise`` lacks bit 1).
* Tensor-typed ``actual_seq_*`` arguments are read by torch's argument parser (a device read: inside
  a capture that is a host sync and raises).
* ``npu_scatter_nd_update_`` with duplicate indices: last write wins (undefined on the device).
* Block ids are not validated by the real op; the emulator only gathers the blocks a request needs
  and torch raises ``IndexError`` for ids outside the cache.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

from hal.backends.npu.emulator import runtime
from hal.backends.npu.emulator.errors import CaptureSyncError, NpuOpError
from hal.backends.npu.emulator.fia import FIA_V2
from hal.backends.npu.emulator.runtime import NPUGraph, Stream
from hal.backends.npu.emulator.scatter import npu_scatter_nd_update_
from hal.backends.npu.runtime import TORCH_NPU_OPS, TORCH_NPU_RUNTIME, NpuRuntime

__all__ = [
    "CaptureSyncError",
    "NPUGraph",
    "NpuOpError",
    "Stream",
    "emulated",
    "install",
    "is_installed",
    "npu_runtime",
    "uninstall",
]


def _build_modules() -> tuple[types.ModuleType, types.ModuleType]:
    # Exactly the names the backend calls (hal.backends.npu.runtime's lists), no more.
    npu = types.ModuleType("torch_npu.npu", "Emulated torch.npu (hal.backends.npu.emulator).")
    for name in TORCH_NPU_RUNTIME:
        setattr(npu, name, getattr(runtime, name))
    top = types.ModuleType("torch_npu", "Emulated torch_npu (hal.backends.npu.emulator): CPU stand-in, not Ascend.")
    top.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    top.__version__ = "emulator"  # type: ignore[attr-defined]
    top.IS_HAL_EMULATOR = True  # type: ignore[attr-defined]
    top.npu = npu  # type: ignore[attr-defined]
    ops = {"npu_fused_infer_attention_score_v2": FIA_V2, "npu_scatter_nd_update_": npu_scatter_nd_update_}
    assert tuple(ops) == TORCH_NPU_OPS, "the emulator provides exactly the ops the backend calls"
    for name, op in ops.items():
        setattr(top, name, op)
    return top, npu


_TORCH_NPU, _TORCH_NPU_NPU = _build_modules()
_RUNTIME = NpuRuntime(torch_npu=_TORCH_NPU, npu=_TORCH_NPU_NPU, emulated=True)
_MISSING = object()
_saved_torch_npu_attr: Any = _MISSING
_install_lock = threading.Lock()


def npu_runtime() -> NpuRuntime:
    """The emulator's ``torch_npu`` / ``torch.npu`` for one backend, installed nowhere."""
    return _RUNTIME


def is_installed() -> bool:
    return sys.modules.get("torch_npu") is _TORCH_NPU


def install(*, device_count: int = 1) -> None:
    """Install the emulator as ``torch_npu`` / ``torch.npu`` (idempotent)."""
    global _saved_torch_npu_attr
    with _install_lock:
        if device_count < 1:
            raise ValueError(f"device_count must be >= 1, got {device_count}")
        runtime.set_device_count(device_count)
        if is_installed():
            return
        if "torch_npu" in sys.modules:
            raise RuntimeError("a real torch_npu is already imported; the emulator will not shadow it")
        _saved_torch_npu_attr = getattr(torch, "npu", _MISSING)
        sys.modules["torch_npu"] = _TORCH_NPU
        sys.modules["torch_npu.npu"] = _TORCH_NPU_NPU
        setattr(torch, "npu", _TORCH_NPU_NPU)  # noqa: B010


def uninstall() -> None:
    """Remove the emulator from ``sys.modules`` and ``torch.npu`` (no-op if it is not installed)."""
    global _saved_torch_npu_attr
    with _install_lock:
        if not is_installed():
            return
        del sys.modules["torch_npu"]
        sys.modules.pop("torch_npu.npu", None)
        if _saved_torch_npu_attr is _MISSING:
            if hasattr(torch, "npu"):
                delattr(torch, "npu")
        else:
            setattr(torch, "npu", _saved_torch_npu_attr)  # noqa: B010
        _saved_torch_npu_attr = _MISSING


@contextlib.contextmanager
def emulated(*, device_count: int = 1) -> Iterator[types.ModuleType]:
    """``with emulated() as torch_npu:`` -- installed inside, reverted after (if it installed it)."""
    was_installed = is_installed()
    install(device_count=device_count)
    try:
        yield _TORCH_NPU
    finally:
        if not was_installed:
            uninstall()
