"""vLLM platform ``hal`` (``HAL_VLLM_PLATFORM=1``): vLLM's own platform for the device hal picks,
with hal's attention backend in place of the device's own.

The in-tree platform stays the base class so everything hal does not replace (memory, distributed,
compilation) is vLLM's. The hal backend is resolved once, here (``HAL_VLLM_DEVICE``, default
``auto``), and every attention backend vLLM builds under this platform uses it.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import hal
from hal.errors import UnsupportedConfigError
from hal.integrations.vllm.plugin import BACKEND_PATH, DEVICE_ENV, PLATFORM_ENV

# hal device type -> vLLM's in-tree platform class for it (on Ascend, vllm-ascend's).
IN_TREE_PLATFORMS = {
    "cpu": "vllm.platforms.cpu.CpuPlatform",
    "cuda": "vllm.platforms.cuda.CudaPlatform",
    "npu": "vllm_ascend.platform.NPUPlatform",
}


def in_tree_platform_class(device_type: str) -> type:
    """vLLM's platform class for a hal device type."""
    try:
        module, _, name = IN_TREE_PLATFORMS[device_type].rpartition(".")
    except KeyError:
        raise UnsupportedConfigError(
            f"{PLATFORM_ENV}=1: hal's device {device_type!r} has no vLLM platform; expected one of {sorted(IN_TREE_PLATFORMS)}"
        ) from None
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


_HAL_BACKEND = hal.get_backend(os.environ.get(DEVICE_ENV, "auto"))
_IN_TREE: Any = in_tree_platform_class(_HAL_BACKEND.device.type)


class HalPlatform(_IN_TREE):  # type: ignore[misc]
    """vLLM's platform for the device, whose attention backend is hal's."""

    #: The hal backend whose pools and kernels serve vLLM in this process.
    hal_backend = _HAL_BACKEND

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None) -> str:
        if getattr(attn_selector_config, "use_mla", False) or getattr(attn_selector_config, "use_sparse", False):
            raise UnsupportedConfigError(
                f"{PLATFORM_ENV}=1: the model uses {'sparse' if attn_selector_config.use_sparse else 'MLA'} attention; "
                "hal's attention backend serves multi-head and grouped-query attention"
            )
        return BACKEND_PATH
