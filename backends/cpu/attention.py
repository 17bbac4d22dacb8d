"""The CPU backend's kernel: ``paged_attention`` (this package's) on the pool, with a gather workspace."""

from __future__ import annotations

import threading
from typing import Any

import torch

from hal.backends.cpu.paged_attention import GatherWorkspace, paged_attention
from hal.backends.cpu.tile_plan import plan_attention
from hal.sdk import AttentionKernelBase, ForwardPlan, KVPool, LayerSpec


class CpuAttention(AttentionKernelBase):
    """The CPU ``AttentionKernel``: ``paged_attention`` over the layer's sub-pool.

    Threading: safe to call from several threads at once; each thread gathers into its own
    workspace (a shared one would let one thread's gather overwrite another's K/V mid-matmul).
    """

    serves_trees = True

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self._per_thread = threading.local()

    @property
    def workspace(self) -> GatherWorkspace:
        """The calling thread's gather workspace."""
        workspace: GatherWorkspace | None = getattr(self._per_thread, "workspace", None)
        if workspace is None:
            workspace = self._per_thread.workspace = GatherWorkspace()
        return workspace

    def _attend(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        metadata = plan.metadata
        table = self.block_table(layer, metadata)
        heads, dk, dv = self.pool.spec.layer_dims(layer.layer_id)
        # torch's fused attention takes no sink logit, and is slower than the explicit matmuls where
        # the qk and v head dims differ
        fused = sinks is None and dk == dv
        kind = ("cpu-plan", layer.sliding_window, table is metadata.block_table, heads * (dk + dv), fused)

        def index_plan() -> Any:
            tree = metadata.tree_mask if metadata.tree_mask_host is None else metadata.tree_mask_host
            return plan_attention(metadata.kv_lens_cpu, metadata.q_lens_cpu, table, self.pool.spec.page_size,
                                  sliding_window=layer.sliding_window, token_bytes=heads * (dk + dv) * 4, fused=fused,
                                  in_place=True, tree_mask=tree)

        # Layers of one kind share the index plan: index tensors and masks are built once per forward.
        return self._paged(paged_attention, q, layer, plan, sinks, workspace=self.workspace,
                           plan=plan.per_layer_kind(kind, index_plan))
