"""The CPU backend's kernel: the compiled kernel (``native``) for chains (decode, verify and draft
steps, prompts), ``paged_attention`` (pure torch, with a gather workspace) for draft trees, calls
that need gradients, and every batch when the library is not in use."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

import torch

from hal.backends.cpu import native
from hal.backends.cpu.paged_attention import GatherWorkspace, paged_attention
from hal.backends.cpu.tile_plan import plan_attention
from hal.sdk import AttentionKernelBase, ForwardPlan, KVPool, LayerSpec

# The compiled kernel costs about the same per (query row, key, head) whatever the head dims, with
# next to nothing per call; the torch kernel about half a millisecond per call, then runs prompts
# through torch's flash attention. Where the library runs prompts by tiles (``native.tiles_prompts``)
# it is the faster of the two at every length measured (4 requests of up to 896 tokens, 4 query
# heads of 32 and 16 of 128), and takes every chain. Row by row, it is faster up to 64-token
# prompts with 4 heads of 32 and to 128 with 16 of 128: then it takes a batch of up to
# NATIVE_MAX_QUERY_ROWS rows per request (decode, verify, draft steps) or of up to
# NATIVE_MAX_ROW_KEY_PAIRS (query row, key) pairs in all (short prompts).
NATIVE_MAX_QUERY_ROWS = 16
NATIVE_MAX_ROW_KEY_PAIRS = 4 * 64 * 128


class CpuAttention(AttentionKernelBase):
    """The CPU ``AttentionKernel``: ``paged_attention`` over the layer's sub-pool.

    Threading: safe to call from several threads at once; each thread gathers into its own
    workspace (a shared one would let one thread's gather overwrite another's K/V mid-matmul).
    """

    serves_trees = True

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self._per_thread = threading.local()
        self._caches: dict[int, native.LayerCaches] = {}  # by layer id: the pool's buffers stay where they are

    @property
    def workspace(self) -> GatherWorkspace:
        """The calling thread's gather workspace."""
        workspace: GatherWorkspace | None = getattr(self._per_thread, "workspace", None)
        if workspace is None:
            workspace = self._per_thread.workspace = GatherWorkspace()
        return workspace

    def _write_and_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None,
        out: torch.Tensor | None = None, checked_as: Hashable | None = None,
    ) -> torch.Tensor:
        # The compiled kernel writes the new rows and attends in one call, into out.
        route = self._native_route(q, layer, plan, sinks, checked_as, k, v)
        if route is not None:
            prepared, slots = route
            assert slots is not None  # derived with the new rows
            return prepared(q, self._layer_caches(layer.layer_id), sinks, write=(slots, k, v), out=out)
        return super()._write_and_attend(q, k, v, layer, plan, sinks, out, checked_as)

    def _attend_into(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None, out: torch.Tensor | None,
        checked_as: Hashable | None = None,
    ) -> torch.Tensor:
        route = self._native_route(q, layer, plan, sinks, checked_as)
        if route is not None:
            return route[0](q, self._layer_caches(layer.layer_id), sinks, out=out)
        return self._torch_attend(q, layer, plan, sinks)

    def _attend(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        return self._attend_into(q, layer, plan, sinks, None)

    def _layer_caches(self, layer_id: int) -> native.LayerCaches:
        caches = self._caches.get(layer_id)
        if caches is None:
            caches = self._caches[layer_id] = native.LayerCaches(self.pool.k_buffer(layer_id), self.pool.v_buffer(layer_id))
        return caches

    def _native_route(self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None,
                      checked_as: Hashable | None, *new_rows: torch.Tensor) -> tuple[native.PreparedAttention, torch.Tensor | None] | None:
        """The compiled call for this kind of layer in this forward and the pool slots the new rows
        go to (``pool.slots_for_forward``, after its checks), when the compiled kernel takes the
        call: the forward (``_native_serves``), the layer's caches, and q and the new rows as they
        are (a unit stride along each head dim), with no gradient to keep; else None. Worked out
        by the first call of each ``checked_as`` key: every call of that key passes the same way."""
        if q.stride(-1) != 1 or any(t.stride(-1) != 1 for t in new_rows) or _needs_grad(q, sinks, *new_rows):
            return None
        if checked_as is None:
            return self._derive_route(q, layer, plan, new_rows)
        return plan.per_layer_kind(("cpu-native-route", checked_as), self._derive_route, q, layer, plan, new_rows)

    def _derive_route(self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan,
                      new_rows: tuple[torch.Tensor, ...]) -> tuple[native.PreparedAttention, torch.Tensor | None] | None:
        if not plan.per_layer_kind(("cpu-native", layer.v_head_dim), lambda: self._native_serves(plan, layer.v_head_dim)):
            return None
        caches = self._layer_caches(layer.layer_id)
        if not native.reads_rows(q, caches.k, caches.v, *new_rows) or _needs_grad(caches.k, caches.v):
            return None
        metadata = plan.metadata
        prepared = plan.per_layer_kind(("cpu-native-call", self.layer_kind(layer)), lambda: native.PreparedAttention(
            self.block_table(layer, metadata), metadata.kv_lens, metadata.cu_q_lens, dtype=q.dtype, page_size=self.pool.spec.page_size,
            num_q_heads=layer.num_q_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, v_head_dim=layer.v_head_dim,
            scaling=layer.scaling, sliding_window=layer.sliding_window,
        ))
        slots = self.pool.slots_for_forward(layer.layer_id, plan, *new_rows) if new_rows else None
        return prepared, slots

    def _torch_attend(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        """``paged_attention`` (pure torch) over the layer's sub-pool, with an index plan per kind of layer."""
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

    def _native_serves(self, plan: ForwardPlan, v_head_dim: int) -> bool:
        """Whether the compiled kernel takes this forward's layers of this value head dim: a chain
        (no tree) whose metadata it reads as it is, with the library built
        (``native.native_status``); prompts of any length where it runs them by tiles, else at most
        ``NATIVE_MAX_QUERY_ROWS`` rows per request or ``NATIVE_MAX_ROW_KEY_PAIRS`` in all."""
        metadata = plan.metadata
        tables = [t for t in (metadata.block_table, metadata.swa_block_table) if t is not None]
        if (metadata.tree_mask is not None or not native.available()
                or not all(native.reads_lengths(t, metadata.kv_lens, metadata.cu_q_lens) for t in tables)):
            return False
        if native.tiles_prompts(v_head_dim):
            return True
        q_lens, kv_lens = metadata.q_lens_cpu, metadata.kv_lens_cpu
        return (max(q_lens, default=0) <= NATIVE_MAX_QUERY_ROWS
                or sum(q * kv for q, kv in zip(q_lens, kv_lens)) <= NATIVE_MAX_ROW_KEY_PAIRS)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd must see the attention (the compiled kernel has no backward)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
