"""``CudaAttention``: the Triton paged-attention kernel behind the ``AttentionKernel`` protocol."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hal.attention import block_table_for, validate_attention_call
from hal.errors import KVLayoutError
from hal.metadata import AttentionMetadata
from hal.protocols import KVPool
from hal.spec import LayerSpec


class CudaAttention:
    """Writes the new K/V by indexed copy, then runs one Triton kernel over the paged cache.

    Every length comes from the metadata's device tensors, so the kernel needs no host-side
    update between graph replays (``updatable_params`` is empty).
    """

    seq_len_fill_value = 1

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: LayerSpec,
        metadata: AttentionMetadata,
        save_kv_cache: bool = True,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        validate_attention_call(self.pool, q, k, v, layer, metadata, sinks)
        for name, x in (("q", q), ("sinks", sinks), ("metadata.kv_lens", metadata.kv_lens)):
            if x is not None and x.device != self.pool.device:
                raise KVLayoutError(f"layer {layer.layer_id}: {name} is on {x.device}, the KV pool is on {self.pool.device}")
        from backends.cuda.triton_attention import check_head_dims, paged_attention  # imports triton

        check_head_dims(layer.head_dim, layer.v_head_dim)  # before the write: a refused call changes nothing
        if save_kv_cache:
            self.pool.set_kv(layer.layer_id, metadata.out_cache_loc, k, v)

        # Tile height follows the rows per request, which only uniform-length modes fix.
        rows_hint = metadata.q_lens_cpu[0] if metadata.mode.has_uniform_query_len() and metadata.q_lens_cpu else 64
        return paged_attention(
            q,
            self.pool.k_buffer(layer.layer_id),
            self.pool.v_buffer(layer.layer_id),
            block_table_for(self.pool, layer, metadata),
            metadata.kv_lens,
            metadata.cu_q_lens,
            scaling=layer.scaling,
            sliding_window=layer.sliding_window,
            sinks=sinks,
            query_rows_hint=rows_hint,
        )

    def updatable_params(self, metadata: AttentionMetadata, layer: LayerSpec) -> Mapping[str, Any]:
        return {}  # reads only the metadata tensors, which the runner refreshes in place
