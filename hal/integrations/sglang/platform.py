"""SGLang platform ``hal`` (``SGLANG_PLATFORM=hal``): SGLang's own platform for the device hal
picks, with hal's attention backend, KV pool, graph backend and multi-layer EAGLE draft-extend
runner in place of the device's own.

The in-tree platform stays the base class so everything hal does not replace (distributed groups,
memory queries, quantization) is SGLang's. Which one that is follows the hal backend the process
serves with, resolved by ``hal.integrations.edge`` (``HAL_SGLANG_DEVICE``, ``HAL_SGLANG_EMULATE``)
when SGLang first reads ``HalPlatform`` from this module: importing the module resolves nothing.
"""

from __future__ import annotations

import functools
from typing import Any

from hal.errors import UnsupportedConfigError
from hal.integrations.edge import edge_backend, in_tree_platform_class, lazy_platform
from hal.integrations.sglang.plugin import NAME, SPECULATIVE_ALGORITHMS, bound_to

# SGLang resolves its platform while ``sglang.srt.platforms`` is still importing: this module
# imports no SGLang module at load time; the class and the hooks import what they need.

#: The phase the patched multi-layer EAGLE worker asks ``get_speculative_graph_runner_cls`` for.
MULTI_LAYER_DRAFT_EXTEND = "multi_layer_draft_extend"


@functools.cache
def platform_class() -> type:
    """``HalPlatform``, built on the first read: the process's hal backend (the edge's), and SGLang's
    in-tree platform for the device its tensors live on as the base class."""
    from sglang.srt.platforms.interface import PlatformCapabilities

    backend = edge_backend("sglang")
    in_tree: Any = in_tree_platform_class("sglang", backend)

    class HalPlatform(in_tree):  # type: ignore[misc]
        """SGLang's platform for the device, with hal's parts where the platform interface has hooks."""

        #: The hal backend whose pools, kernels and graphs serve SGLang.
        hal_backend = backend

        capabilities = PlatformCapabilities(
            supports_triton=in_tree.capabilities.supports_triton,
            graph_capture=backend.captures_graphs,  # hal's graphs replay without re-running Python
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

        def get_graph_runner_cls(self) -> type | None:
            # A backend whose graphs replay without Python (NPUGraph, CUDA graphs, emulated or not)
            # gets SGLang's own decode/verify graph runner, capturing through get_full_graph_backend_cls.
            if not backend.captures_graphs:
                return super().get_graph_runner_cls()  # type: ignore[no-any-return]
            from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

            return DecodeCudaGraphRunner

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
            from hal.integrations.sglang.draft import HalMultiStepDraftBackend

            return HalMultiStepDraftBackend(draft_model_runner, self.hal_backend, topk, num_steps)

    return HalPlatform


__getattr__ = lazy_platform(platform_class)
