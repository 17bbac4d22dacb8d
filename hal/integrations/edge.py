"""The edge between an engine process and hal: the one hal backend the process serves with.

It is resolved once, lazily, when the engine activates hal's platform (or, without the platform,
first asks for hal's attention backend), from the engine's setting, read here and nowhere else:

- ``HAL_<ENGINE>_DEVICE``: a hal device string (``npu``, ``npu:1``, ``cuda``, ``cpu``, ``auto``);
  unset, the engine's own device when it names one, else ``auto``;
- ``HAL_<ENGINE>_EMULATE=1``: that device's backend on its CPU emulator (the emulator is the
  backend's own, so the engine and every library beside it still see the machine they run on).

Everything inside receives the resolved ``hal.Backend``; nothing below looks one up again.
Importing this module resolves nothing.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from typing import Any

import hal
from hal.errors import UnsupportedConfigError

#: The engines hal plugs into, by the name their settings carry.
ENGINES = ("sglang", "vllm")

#: Per engine: hal device type -> the engine's in-tree platform class for it (on Ascend under vLLM,
#: vllm-ascend's). An emulated backend's tensors live on the host: the engine runs its CPU platform.
IN_TREE_PLATFORMS: dict[str, dict[str, str]] = {
    "sglang": {
        "cpu": "sglang.srt.platforms.cpu.CpuSRTPlatform",
        "cuda": "sglang.srt.platforms.cuda.CudaSRTPlatform",
        "npu": "sglang.srt.platforms.npu.NPUSRTPlatform",
    },
    "vllm": {
        "cpu": "vllm.platforms.cpu.CpuPlatform",
        "cuda": "vllm.platforms.cuda.CudaPlatform",
        "npu": "vllm_ascend.platform.NPUPlatform",
    },
}

_resolved: dict[str, hal.Backend] = {}
_lock = threading.Lock()


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise UnsupportedConfigError(f"hal's edge: unknown engine {engine!r}, expected one of {list(ENGINES)}")


def device_setting(engine: str) -> tuple[str | None, bool]:
    """(``HAL_<ENGINE>_DEVICE`` or None, whether ``HAL_<ENGINE>_EMULATE=1``)."""
    _check_engine(engine)
    prefix = f"HAL_{engine.upper()}"
    emulate = os.environ.get(f"{prefix}_EMULATE", "")
    if emulate not in ("", "0", "1"):
        raise UnsupportedConfigError(f"{prefix}_EMULATE={emulate!r}: expected 1 (emulate) or 0 / unset")
    return os.environ.get(f"{prefix}_DEVICE") or None, emulate == "1"


def edge_backend(engine: str, *, engine_device: str | None = None) -> hal.Backend:
    """The backend ``engine`` serves with in this process, resolved on the first call (see the
    module doc); ``engine_device``: the device the engine itself runs on, used when the setting
    names none."""
    with _lock:
        if engine not in _resolved:
            device, emulate = device_setting(engine)
            _resolved[engine] = hal.get_backend(device or engine_device or "auto", emulate=emulate)
        return _resolved[engine]


def in_tree_platform_class(engine: str, backend: hal.Backend) -> type:
    """The engine's own platform class for the device ``backend``'s tensors live on."""
    _check_engine(engine)
    table = IN_TREE_PLATFORMS[engine]
    try:
        module, _, name = table[backend.device.type].rpartition(".")
    except KeyError:
        raise UnsupportedConfigError(
            f"hal's {engine} platform: hal's backend {backend!r} runs on {backend.device.type!r}, which has no "
            f"{engine} platform; expected one of {sorted(table)}"
        ) from None
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def lazy_platform(build: Callable[[], type]) -> Callable[[str], Any]:
    """A platform module's ``__getattr__``: ``HalPlatform`` is built by ``build`` on its first read
    (when the engine activates hal), so importing the module resolves nothing."""

    def module_getattr(name: str) -> Any:
        if name == "HalPlatform":
            return build()
        raise AttributeError(f"module has no attribute {name!r}")

    return module_getattr


def reset_for_tests() -> None:
    """Forget the resolved backends (a test that changes the settings in one process)."""
    with _lock:
        _resolved.clear()


__all__ = ["ENGINES", "IN_TREE_PLATFORMS", "device_setting", "edge_backend", "in_tree_platform_class", "lazy_platform"]
