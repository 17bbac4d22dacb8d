"""``CudaAttention``: the Triton paged-attention kernel behind hal's ``AttentionKernelBase``."""

from __future__ import annotations

import torch

from hal.sdk import AttentionKernelBase, ForwardPlan, LayerSpec, tree_depths


class CudaAttention(AttentionKernelBase):
    """Writes the new K/V by indexed copy, then runs one Triton kernel over the paged cache.

    Every length comes from the metadata's device tensors, so the kernel needs no host-side
    update between graph replays (``updatable_params`` is empty).
    """

    serves_trees = True

    @classmethod
    def unsupported_reason(
        cls, layer: LayerSpec, kv_dtype: torch.dtype, page_size: int, max_q_len: int = 1, batch_size: int = 1
    ) -> str | None:
        from hal.backends.cuda.triton_attention import head_dims_reason  # imports triton

        return head_dims_reason(layer.head_dim, layer.v_head_dim)

    def _attend(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        from hal.backends.cuda.triton_attention import paged_attention

        # Tile height follows the rows per request, which only uniform-length modes fix.
        metadata = plan.metadata
        rows_hint = metadata.q_lens_cpu[0] if metadata.mode.has_uniform_query_len() and metadata.q_lens_cpu else 64
        depths = None
        if metadata.tree_mask is not None:  # once per forward, on the device (a capture records it)
            tree = metadata.tree_mask
            depths = plan.per_layer_kind("tree-depths", lambda: tree_depths(tree).to(torch.int32).reshape(-1))
        return self._paged(paged_attention, q, layer, plan, sinks, query_rows_hint=rows_hint, tree_depths=depths)
