"""SGLang platform ``hal`` (``SGLANG_PLATFORM=hal``): SGLang's own platform for the device hal
picks, with hal's attention backend, KV pool, graph backend and multi-layer EAGLE draft-extend
runner in place of the device's own.

The in-tree platform stays the base class so everything hal does not replace (distributed groups,
memory queries, quantization) is SGLang's. Which in-tree platform that is comes from hal's backend
for ``auto`` (``HAL_SGLANG_DEVICE`` names another device; ``HAL_SGLANG_EMULATE=1`` runs it on
hal's emulator of its runtime, with SGLang on the CPU), looked up by where the backend's tensors
live in one table.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import hal
from hal.errors import UnsupportedConfigError
from hal.integrations.sglang.plugin import NAME, SPECULATIVE_ALGORITHMS, bound_to
from sglang.srt.platforms.interface import PlatformCapabilities

# SGLang resolves its platform while ``sglang.srt.platforms`` is still importing: this module
# imports no other SGLang module at load time; the hooks import what they return.

#: The phase the patched multi-layer EAGLE worker asks ``get_speculative_graph_runner_cls`` for.
MULTI_LAYER_DRAFT_EXTEND = "multi_layer_draft_extend"

# hal device type -> the in-tree SGLang platform class for it.
IN_TREE_PLATFORMS = {
    "cpu": "sglang.srt.platforms.cpu.CpuSRTPlatform",
    "cuda": "sglang.srt.platforms.cuda.CudaSRTPlatform",
    "npu": "sglang.srt.platforms.npu.NPUSRTPlatform",
}


def in_tree_platform_class(device_type: str) -> type:
    """SGLang's platform class for a hal device type."""
    try:
        module, _, name = IN_TREE_PLATFORMS[device_type].rpartition(".")
    except KeyError:
        raise UnsupportedConfigError(
            f"SGLANG_PLATFORM=hal: hal's device {device_type!r} has no SGLang platform; expected one of {sorted(IN_TREE_PLATFORMS)}"
        ) from None
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]



# The one hal backend this process serves with, resolved once, when SGLang activates this platform
# (the in-tree base class depends on its device), and handed inward: the classes SGLang builds from
# the hooks below are bound to it (``bound_to``); nothing below looks it up again.
_HAL_BACKEND = hal.get_backend(os.environ.get("HAL_SGLANG_DEVICE", "auto"), emulate=os.environ.get("HAL_SGLANG_EMULATE") == "1")
# SGLang runs on the device the backend's tensors live on: an emulated backend's are on the host.
_IN_TREE: Any = in_tree_platform_class(_HAL_BACKEND.device.type)


class HalPlatform(_IN_TREE):  # type: ignore[misc]
    """SGLang's platform for the device, with hal's parts where the platform interface has hooks."""

    #: The hal backend whose pools, kernels and graphs serve SGLang.
    hal_backend = _HAL_BACKEND

    capabilities = PlatformCapabilities(
        supports_triton=_IN_TREE.capabilities.supports_triton,
        graph_capture=_HAL_BACKEND.captures_graphs,  # hal's graphs replay without re-running Python
    )

    def is_out_of_tree(self) -> bool:
        # SGLang consults the graph-backend and speculative-runner hooks of out-of-tree platforms
        # only; what the device is stays as the in-tree base class answers it.
        return True

    def get_default_attention_backend(self) -> str:
        return NAME

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        # The EAGLE family (NEXTN is SGLang's alias of EAGLE; on MiMo-V2-Flash, EAGLE is its
        # multi-layer EAGLE, MTP) and NGRAM; trees need a kernel that serves them, which the
        # attention backend checks at start-up (plugin.check_speculative_configuration).
        return str(algorithm).upper() in SPECULATIVE_ALGORITHMS

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return NAME

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return backend == NAME

    def get_kv_pool_cls(self, *, kind: str) -> type | None:
        if kind == "mha":
            from hal.integrations.sglang.kv_pool import HalMHATokenToKVPool

            return bound_to(HalMHATokenToKVPool, self.hal_backend)
        return super().get_kv_pool_cls(kind=kind)  # type: ignore[no-any-return]

    def get_full_graph_backend_cls(self) -> type:
        from hal.integrations.sglang.graph import HalGraphBackend

        return bound_to(HalGraphBackend, self.hal_backend)

    def get_speculative_graph_runner_cls(self, algorithm: str, phase: str) -> type | None:
        # The multi-layer EAGLE worker asks with this phase once patches/ is applied; SGLang names
        # its algorithm EAGLE either way.
        if phase == MULTI_LAYER_DRAFT_EXTEND:
            from hal.integrations.sglang.graph import HalMultiLayerEagleDraftExtendRunner

            return HalMultiLayerEagleDraftExtendRunner
        return super().get_speculative_graph_runner_cls(algorithm, phase)  # type: ignore[no-any-return]

    def create_speculative_draft_decode_backend(self, backend: str, draft_model_runner: Any, topk: int, num_steps: int) -> Any:
        """The multi-step draft decode backend SGLang's EAGLE worker drafts with (asked once
        ``patches/draft_utils_platform_draft_backends.patch`` is applied): hal's, over this
        platform's hal backend."""
        if backend != NAME:
            raise UnsupportedConfigError(f"SGLANG_PLATFORM={NAME} drafts with attention backend {NAME!r} only, got {backend!r}")
        from hal.integrations.sglang.attention import HalMultiStepDraftBackend

        return HalMultiStepDraftBackend(draft_model_runner, self.hal_backend, topk, num_steps)
