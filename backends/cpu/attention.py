"""The CPU backend's kernel: hal's reference ``paged_attention`` on the pool, with a gather workspace."""

from __future__ import annotations

import torch

from hal.sdk import AttentionKernelBase, AttentionMetadata, GatherWorkspace, KVPool, LayerSpec, paged_attention


class CpuAttention(AttentionKernelBase):
    """Reference ``AttentionKernel``: ``paged_attention`` over the layer's sub-pool.

    Threading: the gather workspace belongs to the kernel, so one kernel serves one thread.
    """

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self.workspace = GatherWorkspace()

    def _attend(
        self, q: torch.Tensor, layer: LayerSpec, metadata: AttentionMetadata, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        return self._paged(paged_attention, q, layer, metadata, sinks, workspace=self.workspace)
