"""vLLM platform ``hal`` (``HAL_VLLM_PLATFORM=1``): vLLM's own platform for the device hal picks,
with hal's attention backend in place of the device's own.

The in-tree platform stays the base class so everything hal does not replace (memory, distributed,
compilation) is vLLM's. Which one that is follows the hal backend the process serves with,
resolved by ``hal.integrations.edge`` (``HAL_VLLM_DEVICE``, ``HAL_VLLM_EMULATE``) when vLLM first
reads ``HalPlatform`` from this module; every attention backend vLLM builds under it uses that
backend. Importing the module resolves nothing.
"""

from __future__ import annotations

import functools
from typing import Any

from hal.errors import UnsupportedConfigError
from hal.integrations.edge import edge_backend, in_tree_platform_class, lazy_platform
from hal.integrations.vllm.plugin import BACKEND_PATH, PLATFORM_ENV


@functools.cache
def platform_class() -> type:
    """``HalPlatform``, built on the first read (see the module doc)."""
    backend = edge_backend("vllm")
    in_tree: Any = in_tree_platform_class("vllm", backend)

    class HalPlatform(in_tree):  # type: ignore[misc]
        """vLLM's platform for the device, whose attention backend is hal's."""

        #: The hal backend whose pools and kernels serve vLLM in this process.
        hal_backend = backend

        @classmethod
        def get_attn_backend_cls(cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None) -> str:
            if getattr(attn_selector_config, "use_mla", False) or getattr(attn_selector_config, "use_sparse", False):
                raise UnsupportedConfigError(
                    f"{PLATFORM_ENV}=1: the model uses {'sparse' if attn_selector_config.use_sparse else 'MLA'} attention; "
                    "hal's attention backend serves multi-head and grouped-query attention"
                )
            return BACKEND_PATH

    return HalPlatform


__getattr__ = lazy_platform(platform_class)
