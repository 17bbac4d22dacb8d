"""``AttentionKernelBase``: the attention-kernel template every backend fills in.

``plan(metadata)`` is the step a caller takes once per forward (``hal.plan.ForwardPlan``: the
metadata checked against this kernel's pool); ``forward`` is written once, here, in the order that
keeps a refused call harmless:

1. the plan fits this pool and capture; ``validate_attention_call``: shapes, dtypes, devices and SWA routing of every argument;
2. a tree batch on a kernel that does not declare ``serves_trees``, and ``check_supported``: the
   backend's own limits (``UnsupportedConfigError``), before any write;
3. ``pool.set_kv_for_forward``: the new K/V (when ``save_kv_cache``);
4. ``_attend``: the hardware-specific part, over the paged cache, with the forward's plan.

A kernel that writes the new K/V as it attends (one call for both) overrides ``_write_and_attend``
(steps 3 and 4), asking the pool where the rows go (``pool.slots_for_forward``, after its checks).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import attrs
import torch

from hal.errors import SpecError, UnsupportedConfigError
from hal.graph import record_updatable_call
from hal.metadata import AttentionMetadata
from hal.plan import ForwardPlan, call_signature
from hal.protocols import KVPool
from hal.spec import LayerSpec
from hal.validation import validate_attention_call


class AttentionKernelBase:
    """Base class of ``AttentionKernel`` implementations; override ``_attend`` (and, where the
    hardware has limits or host-side op arguments, ``check_supported`` and ``updatable_params``).

    Threading: ``forward`` must be safe from several threads at once; keep per-call scratch per
    thread (``threading.local``), as the CPU kernel does.
    """

    #: KV length of a padded request in a padded graph batch (1: it sees slot 0 of the padding page).
    seq_len_fill_value: int = 1
    #: Whether ``_attend`` computes TARGET_VERIFY batches over draft trees (``metadata.tree_mask``,
    #: see ``hal.tree``); a kernel that does not is refused such batches before anything is written.
    serves_trees: bool = False

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._layer_kinds: dict[LayerSpec, Hashable] = {}

    def plan(self, metadata: AttentionMetadata) -> ForwardPlan:
        """The plan of one forward over this kernel's pool: ``metadata`` checked against the pool
        (typed errors before anything is written). Hand it to every layer's ``forward``."""
        return ForwardPlan(metadata, self.pool)

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        k: torch.Tensor | None,  # [T, num_kv_heads, head_dim]; None only with save_kv_cache=False
        v: torch.Tensor | None,  # [T, num_kv_heads, v_head_dim]; likewise
        layer: LayerSpec,
        plan: ForwardPlan,
        save_kv_cache: bool = True,
        *,
        sinks: torch.Tensor | None = None,  # [num_q_heads], when layer.has_sinks
        out: torch.Tensor | None = None,  # [T, num_q_heads, v_head_dim], q's dtype and device
    ) -> torch.Tensor:  # [T, num_q_heads, v_head_dim]
        """Validate, check support, write the new K/V, then attend over the paged cache; the result
        lands in ``out`` when given (written there by a kernel that can, ``_attend_into``, else
        copied), which is returned."""
        if not isinstance(plan, ForwardPlan):
            raise SpecError(f"{type(self).__name__}.forward takes the forward's plan (kernel.plan(metadata)), got {type(plan).__name__}")
        if not plan.usable_by(self.pool):
            plan.check_usable(self.pool, f"{type(self).__name__}.forward")
        # the checks read types, shapes, dtypes and devices: once for each kind of call (ForwardPlan.check_once)
        kind, signature = self.layer_kind(layer), call_signature("attention", q, k, v, sinks, out, save_kv_cache)
        checked_as = None if kind is None or signature is None else (signature, kind)
        plan.check_once(checked_as, self._check_call, q, k, v, layer, plan, sinks, save_kv_cache, out, passed=self._passed_calls())
        if out is not None and not out.is_contiguous():  # strides are not in the signature
            raise SpecError(f"{type(self).__name__}.forward, layer {layer.layer_id}: out must be contiguous, got strides {out.stride()}")
        if save_kv_cache:
            assert k is not None and v is not None  # validate_attention_call checked them
            result = self._write_and_attend(q, k, v, layer, plan, sinks, out, checked_as)
        else:
            result = self._attend_into(q, layer, plan, sinks, out, checked_as)
        if out is None or result is out:
            return result
        return out.copy_(result.view(out.shape))

    def _passed_calls(self) -> set[Hashable]:
        """The kinds of call that passed ``_check_call`` in earlier forwards (``ForwardPlan.check_once``)."""
        try:
            return self._passed
        except AttributeError:  # a subclass whose __init__ does not reach this class's
            self._passed: set[Hashable] = set()
            return self._passed

    def layer_kind(self, layer: LayerSpec) -> Hashable | None:
        """What a call's checks, and what a kernel prepares per forward, read of a layer besides its
        id: its spec with the id left out, and the dims and sub-pool of its place in the pool. Layers
        of one kind are checked once (``ForwardPlan.check_once``: per forward, and not again in later
        forwards of the same call facts) and share what a kernel derives for them
        (``ForwardPlan.per_layer_kind``). None for anything but a
        ``LayerSpec`` of a layer the pool holds (then checked at every call, which names the fault)."""
        if type(layer) is not LayerSpec:
            return None
        try:
            kinds = self._layer_kinds
        except AttributeError:  # a subclass whose __init__ does not reach this class's
            kinds = self._layer_kinds = {}
        kind = kinds.get(layer)
        if kind is None:
            spec = self.pool.spec
            if not 0 <= layer.layer_id < spec.num_layers:
                return None
            kind = (attrs.evolve(layer, layer_id=0), spec.layer_dims(layer.layer_id), self.pool.is_swa_layer(layer.layer_id))
            # one object per kind: the plan's lookups then match by identity, never comparing specs
            kind = kinds[layer] = next((known for known in kinds.values() if known == kind), kind)
        return kind

    def _check_call(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec, plan: ForwardPlan,
                    sinks: torch.Tensor | None, save_kv_cache: bool, out: torch.Tensor | None) -> None:
        """Steps 1 and 2 of ``forward`` (see the module doc), after the plan's own check."""
        validate_attention_call(self.pool, q, k, v, layer, plan.metadata, sinks, save_kv_cache, out)
        if plan.metadata.tree_mask is not None and not self.serves_trees:
            raise UnsupportedConfigError(f"{type(self).__name__}, layer {layer.layer_id}: this kernel verifies chains; "
                                         "the batch is a draft tree (metadata.tree_mask)")
        self.check_supported(layer, plan.metadata)

    def _write_and_attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None,
        out: torch.Tensor | None = None, checked_as: Hashable | None = None,
    ) -> torch.Tensor:
        """The new K/V into the layer's cache, then ``_attend_into``. ``checked_as``: the key the
        call's checks passed under in this plan (its signature and layer kind; None when checked
        call by call): what a kernel derives for every call of that key may go in
        ``plan.per_layer_kind`` under it."""
        self.pool.set_kv_for_forward(layer.layer_id, plan, k, v)
        return self._attend_into(q, layer, plan, sinks, out, checked_as)

    def _attend_into(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None, out: torch.Tensor | None,
        checked_as: Hashable | None = None,
    ) -> torch.Tensor:
        """``_attend``, written into ``out`` where the kernel can (a kernel that can overrides this
        and returns ``out``); what it returns otherwise is copied there by ``forward``."""
        return self._attend(q, layer, plan, sinks)

    @classmethod
    def unsupported_reason(
        cls, layer: LayerSpec, kv_dtype: torch.dtype, page_size: int, max_q_len: int = 1, batch_size: int = 1
    ) -> str | None:
        """Why this kernel cannot run ``layer`` over a pool of ``kv_dtype`` in pages of ``page_size``
        for batches of up to ``batch_size`` requests of up to ``max_q_len`` new tokens each, or None
        if it can. Needs no pool and no device: what ``Backend.unsupported_reason`` answers with."""
        return None

    def check_supported(self, layer: LayerSpec, metadata: AttentionMetadata) -> None:
        """Raise ``UnsupportedConfigError`` for a layer or batch the hardware op cannot run (the
        ``unsupported_reason`` of this pool and batch)."""
        spec = self.pool.spec
        reason = self.unsupported_reason(layer, spec.dtype, spec.page_size, max(metadata.q_lens_cpu, default=0), metadata.batch_size)
        if reason is not None:
            raise UnsupportedConfigError(f"{type(self).__name__}, layer {layer.layer_id}: {reason}")

    def _attend(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of ``q`` over the layer's paged cache (the new K/V already written); what the
        kernel derives from the metadata for a kind of layer goes in ``plan.per_layer_kind``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _attend")

    def updatable_params(self, metadata: AttentionMetadata, layer: LayerSpec) -> Mapping[str, Any]:
        """Host-side arguments of one captured op for ``metadata``; kernels reading only device
        tensors (the default) have none, since the runner refreshes those tensors in place."""
        return {}

    def record_updatable_call(self, layer: LayerSpec) -> None:
        """Call once per op with host-side arguments, where it is issued (a no-op outside a capture)."""
        record_updatable_call(self, layer)

    def _paged(
        self,
        paged_attention: Callable[..., torch.Tensor],
        q: torch.Tensor,
        layer: LayerSpec,
        plan: ForwardPlan,
        sinks: torch.Tensor | None,
        /,
        **options: Any,  # the kernel's own keywords (positional-only above: a kernel may take ``plan``)
    ) -> torch.Tensor:
        """Call a kernel with ``hal.oracle.paged_oracle``'s signature on this layer's sub-pool:
        ``paged_attention(q, k_cache, v_cache, block_table, kv_lens, cu_q_lens, scaling=...,
        sliding_window=..., sinks=..., tree_mask=..., **options)``."""
        metadata = plan.metadata
        return paged_attention(
            q,
            self.pool.k_buffer(layer.layer_id),
            self.pool.v_buffer(layer.layer_id),
            self.block_table(layer, metadata),
            metadata.kv_lens,
            metadata.cu_q_lens,
            scaling=layer.scaling,
            sliding_window=layer.sliding_window,
            sinks=sinks,
            tree_mask=metadata.tree_mask,
            **options,
        )

    def block_table(self, layer: LayerSpec, metadata: AttentionMetadata) -> torch.Tensor:
        """The block table addressing ``layer``'s sub-pool (the SWA table for SWA-pool layers)."""
        if self.pool.is_swa_layer(layer.layer_id):
            assert metadata.swa_block_table is not None  # validate_attention_call checked it
            return metadata.swa_block_table
        return metadata.block_table
