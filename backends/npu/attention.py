"""Paged attention on Ascend: one ``npu_fused_infer_attention_score_v2`` call per layer.

Every forward mode goes through the same call: packed query rows (TND), cumulative query ends as
``actual_seq_qlen``, per-request KV lengths (including the new tokens) as ``actual_seq_kvlen``, and
the split K/V pool viewed as ``(num_pages + 1, page_size, kv_heads * dim)`` caches with the block
table. Full layers use the right-down causal mode (3); sliding-window layers the band mode (4)
with ``pre_tokens = W``, ``next_tokens = 0``, which is exactly hal's window convention.

A verify batch over draft trees takes an explicit mask, which TND does not accept: its requests
(all ``N`` rows long) go as BSND ``(B, N, heads, dim)`` with ``sparse_mode=0`` and a ``(B, 1, N,
KV_S)`` mask built on the device once per forward (tree, window and lengths in one tensor). BSND
takes no ``learnable_sink``, so a sink layer asks for the log-sum-exp and adds the sink's term to
the denominator itself: ``out * sigmoid(lse - sink)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hal.backends.npu.kv_pool import NpuKVPool
from hal.sdk import (
    AttentionKernelBase,
    AttentionMetadata,
    ForwardMode,
    ForwardPlan,
    KVPool,
    LayerSpec,
    SpecError,
    tree_depths,
)

INT_MAX = 2147483647
SPARSE_EXPLICIT_MASK = 0
SPARSE_RIGHT_DOWN_CAUSAL = 3
SPARSE_BAND = 4
TEMPLATE_MASK_SIZE = 2048

# What FIA v2 accepts in TND with a paged cache (torch_npu's FIA v2 documentation: heads, paged
# cache, learnable sinks, dtypes and head dims).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
TND_HEAD_DIMS = frozenset({(128, 128), (192, 128), (192, 192)})  # (qk, v)
# The documentation: "GQA and PA do not support V_D = 192". hal's cache is always paged, so (192, 192) is
# refused (MiMo-V2's 192/128 is explicitly allowed).
PAGED_FORBIDDEN_V_HEAD_DIM = 192
SINK_QK_HEAD_DIMS = frozenset({64, 128, 192})
MAX_SINK_V_HEAD_DIM = 128
MAX_GQA_RATIO = 64
MAX_HEADS = 256
MAX_KV_HIDDEN = 65535
MAX_BATCH = 4096

# The host-side length arguments of the FIA call, computed from the metadata in one place: the eager
# call and a captured call's graph update both read them from here.
_HOST_LENGTHS: Mapping[str, Callable[[AttentionMetadata], list[int]]] = {
    # cumulative query ends (TND); per-request query lengths in a tree batch's BSND call
    "actual_seq_qlen": lambda md: list(md.q_lens_cpu if md.tree_mask is not None else md.cu_q_lens_cpu),
    "actual_seq_kvlen": lambda md: list(md.kv_lens_cpu),  # per-request KV length (paged)
}
# Host parameters a captured FIA call needs refreshed on each replay, by forward mode. The query
# offsets of a padded graph batch are fixed, but refreshing them costs nothing and keeps a graph
# correct if its shape ever changes.
UPDATABLE_HOST_PARAMS: Mapping[ForwardMode, tuple[str, ...]] = {
    ForwardMode.EXTEND: ("actual_seq_qlen", "actual_seq_kvlen"),
    ForwardMode.DECODE: ("actual_seq_qlen", "actual_seq_kvlen"),
    ForwardMode.TARGET_VERIFY: ("actual_seq_qlen", "actual_seq_kvlen"),
    ForwardMode.DRAFT_EXTEND_V2: ("actual_seq_qlen", "actual_seq_kvlen"),
    ForwardMode.IDLE: (),
}

_templates: dict[torch.device, torch.Tensor] = {}


def causal_template_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 template FIA sparse modes 3/4 take (True above the diagonal), one per device."""
    if device not in _templates:
        with torch.inference_mode(False):  # shared by every kernel: a plain tensor, whoever builds it first
            ones = torch.ones(TEMPLATE_MASK_SIZE, TEMPLATE_MASK_SIZE, dtype=torch.bool, device=device)
            _templates[device] = torch.triu(ones, diagonal=1)
    return _templates[device]


def host_lengths(metadata: AttentionMetadata) -> dict[str, list[int]]:
    """The FIA v2 host length arguments for ``metadata``."""
    return {name: build(metadata) for name, build in _HOST_LENGTHS.items()}


def unsupported_reason(layer: LayerSpec, dtype: torch.dtype, page_size: int, max_q_len: int, batch: int) -> str | None:
    """Why FIA v2 (TND, paged) cannot run this layer, or None if it can."""
    dk, dv = layer.head_dim, layer.v_head_dim
    if dtype not in SUPPORTED_DTYPES:
        return f"FIA v2 takes float16/bfloat16 queries, the KV pool stores {dtype} (use a bf16 or fp16 pool)"
    if (dk, dv) not in TND_HEAD_DIMS:
        return f"FIA v2 in TND needs (qk, v) head dims in {sorted(TND_HEAD_DIMS)}, layer has ({dk}, {dv})"
    if layer.has_sinks and dk not in SINK_QK_HEAD_DIMS:
        return f"learnable sinks need a qk head dim in {sorted(SINK_QK_HEAD_DIMS)}, layer has {dk}"
    if layer.has_sinks and dv > MAX_SINK_V_HEAD_DIM:
        return f"learnable sinks need a v head dim <= {MAX_SINK_V_HEAD_DIM}, layer has {dv}"
    if dv == PAGED_FORBIDDEN_V_HEAD_DIM:
        return f"FIA v2 with a paged cache does not support v head dim {dv} (documented: GQA and PA do not support V_D = {dv})"
    if layer.group_size > MAX_GQA_RATIO or layer.num_q_heads > MAX_HEADS:
        return (
            f"FIA v2 needs num_q_heads <= {MAX_HEADS} and q/kv heads <= {MAX_GQA_RATIO}, layer has "
            f"{layer.num_q_heads}/{layer.num_kv_heads}"
        )
    if layer.num_kv_heads * dk > MAX_KV_HIDDEN:
        return f"FIA v2 needs kv_heads * head_dim <= {MAX_KV_HIDDEN}, layer has {layer.num_kv_heads * dk}"
    if dk in (64, 128):
        ok, rule = page_size % 16 == 0 and page_size <= 1024, "a multiple of 16 up to 1024"
    elif max_q_len > 1:
        ok, rule = page_size % 128 == 0 and page_size <= 512, "a multiple of 128 in [128, 512] for multi-token queries"
    else:
        ok, rule = page_size % 16 == 0 and page_size <= 512, "a multiple of 16 up to 512"
    if not ok:
        return f"FIA v2 with head dim {dk} needs a page size that is {rule}, the pool has {page_size}"
    if batch > MAX_BATCH:
        return f"FIA v2 in TND takes at most {MAX_BATCH} requests per call, got {batch}"
    return None


def tree_attention_mask(metadata: AttentionMetadata, key_slots: int, sliding_window: int | None) -> torch.Tensor:
    """FIA's explicit mask ``(B, 1, N, key_slots)`` bool, True = hidden, for a verify batch over
    draft trees: row ``i`` of request ``b`` sees the prefix and the block rows its tree names, and
    on a window layer only keys at positions ``>= its position - W`` (positions by depth, as
    ``hal.tree`` defines them). Device tensor ops only, so a captured forward re-derives it on replay."""
    tree = metadata.tree_mask
    assert tree is not None
    batch, rows = tree.shape[0], tree.shape[1]
    device = tree.device
    prefix = (metadata.kv_lens.long() - rows)[:, None]  # [B, 1]
    depth = tree_depths(tree)  # [B, N]
    key = torch.arange(key_slots, device=device)[None, :]  # [1, K]
    block_row = key - prefix  # [B, K]: the key's row in the verify block (< 0: the prefix)
    in_block = (block_row >= 0) & (block_row < rows)
    row_index = block_row.clamp(0, rows - 1)
    sees = torch.gather(tree, 2, row_index[:, None, :].expand(batch, rows, key_slots))  # [B, N, K]
    visible = (block_row < 0)[:, None, :] | (in_block[:, None, :] & sees)
    if sliding_window is not None:
        key_position = torch.where(block_row < 0, key, prefix + torch.gather(depth, 1, row_index))  # [B, K]
        visible &= key_position[:, None, :] >= (prefix + depth - sliding_window)[:, :, None]
    return (~visible)[:, None]


class NpuAttention(AttentionKernelBase):
    """``AttentionKernel`` on Ascend: writes K/V by scatter, then one FIA v2 call."""

    # A padded graph request sees one key (slot 0 of the padding page): FIA's causal mode needs
    # q_len <= kv_len per request, so an empty padded request is not an option.
    seq_len_fill_value = 1
    serves_trees = True

    def __init__(self, pool: KVPool) -> None:
        if not isinstance(pool, NpuKVPool):
            raise SpecError(f"NpuAttention runs over an NpuKVPool (the npu backend's create_kv_pool), got {type(pool).__name__}")
        super().__init__(pool)
        self.runtime = pool.runtime  # the backend's torch_npu handles, as its pool holds them
        self._mask = causal_template_mask(pool.device)
        self._checked: set[tuple[LayerSpec, bool]] = set()

    @classmethod
    def unsupported_reason(
        cls, layer: LayerSpec, kv_dtype: torch.dtype, page_size: int, max_q_len: int = 1, batch_size: int = 1
    ) -> str | None:
        return unsupported_reason(layer, kv_dtype, page_size, max_q_len, batch_size)

    def check_supported(self, layer: LayerSpec, metadata: AttentionMetadata) -> None:
        """Raise UnsupportedConfigError if FIA v2 cannot run ``layer`` on this pool for ``metadata``
        (the base class's check, remembered per layer and query kind)."""
        key = (layer, max(metadata.q_lens_cpu, default=0) > 1)
        if key in self._checked and metadata.batch_size <= MAX_BATCH:
            return
        super().check_supported(layer, metadata)
        self._checked.add(key)

    def fia_arguments(
        self, layer: LayerSpec, metadata: AttentionMetadata, sinks: torch.Tensor | None
    ) -> dict[str, Any]:
        """Keyword arguments of the FIA v2 call for ``layer`` (everything but query/key/value)."""
        swa = layer.sliding_window is not None
        kwargs: dict[str, Any] = {
            "atten_mask": self._mask,
            "block_table": self.block_table(layer, metadata),
            "num_query_heads": layer.num_q_heads,
            "num_key_value_heads": layer.num_kv_heads,
            "softmax_scale": layer.scaling,
            "pre_tokens": layer.sliding_window if swa else INT_MAX,
            "next_tokens": 0 if swa else INT_MAX,
            "input_layout": "TND",
            "sparse_mode": SPARSE_BAND if swa else SPARSE_RIGHT_DOWN_CAUSAL,
            "block_size": self.pool.spec.page_size,
            **host_lengths(metadata),
        }
        if sinks is not None:
            kwargs["learnable_sink"] = sinks.to(torch.bfloat16)
        return kwargs

    def _attend(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        metadata = plan.metadata
        if metadata.num_tokens == 0:
            return q.new_zeros((0, layer.num_q_heads, layer.v_head_dim))
        if metadata.tree_mask is not None:
            return self._attend_tree(q, layer, plan, sinks)
        page_size = self.pool.spec.page_size
        k_cache = self.pool.k_buffer(layer.layer_id)
        v_cache = self.pool.v_buffer(layer.layer_id)
        k_cache = k_cache.view(k_cache.shape[0], page_size, -1)
        v_cache = v_cache.view(v_cache.shape[0], page_size, -1)
        kwargs = self.fia_arguments(layer, metadata, sinks)
        self.record_updatable_call(layer)  # a no-op outside a graph capture
        # FIA v2 takes no non-contiguous tensor; q is often a view of a fused qkv projection.
        out, _ = self.runtime.torch_npu.npu_fused_infer_attention_score_v2(q.contiguous(), k_cache, v_cache, **kwargs)
        return out  # type: ignore[no-any-return]

    def _attend_tree(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        """A verify batch over draft trees: one BSND call with an explicit mask (see the module doc)."""
        metadata = plan.metadata
        batch, rows = metadata.batch_size, metadata.q_lens_cpu[0]
        page_size = self.pool.spec.page_size
        table = self.block_table(layer, metadata)
        k_cache = self.pool.k_buffer(layer.layer_id)
        v_cache = self.pool.v_buffer(layer.layer_id)
        k_cache = k_cache.view(k_cache.shape[0], page_size, -1)
        v_cache = v_cache.view(v_cache.shape[0], page_size, -1)
        mask = plan.per_layer_kind(
            ("fia-tree-mask", layer.sliding_window, table.shape[1]),
            lambda: tree_attention_mask(metadata, table.shape[1] * page_size, layer.sliding_window),
        )
        kwargs: dict[str, Any] = {
            "atten_mask": mask,
            "block_table": table,
            "num_query_heads": layer.num_q_heads,
            "num_key_value_heads": layer.num_kv_heads,
            "softmax_scale": layer.scaling,
            "input_layout": "BSND",
            "sparse_mode": SPARSE_EXPLICIT_MASK,
            "block_size": page_size,
            "return_softmax_lse": sinks is not None,
            **host_lengths(metadata),
        }
        self.record_updatable_call(layer)  # a no-op outside a graph capture
        query = q.reshape(batch, rows, layer.num_q_heads, layer.head_dim).contiguous()
        out, lse = self.runtime.torch_npu.npu_fused_infer_attention_score_v2(query, k_cache, v_cache, **kwargs)
        if sinks is not None:  # the sink's exp(sink) joins each row's denominator exp(lse)
            out = (out.float() * torch.sigmoid(lse.transpose(1, 2) - sinks.float().view(1, 1, -1, 1))).to(out.dtype)
        return out.reshape(batch * rows, layer.num_q_heads, layer.v_head_dim)  # type: ignore[no-any-return]

    def updatable_params(self, metadata: AttentionMetadata, layer: LayerSpec) -> Mapping[str, Any]:
        """The host arguments of this layer's captured FIA call, for ``metadata``."""
        lengths = host_lengths(metadata)
        return {name: lengths[name] for name in UPDATABLE_HOST_PARAMS[metadata.mode]}
