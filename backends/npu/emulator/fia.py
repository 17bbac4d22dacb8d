"""FIA v2 (``npu_fused_infer_attention_score_v2``): argument checks (layouts,
lengths, heads, paged cache, masks and sparse modes, sinks, dtypes and head dims, as the torch_npu
op-plugin documentation and the CANN checkers state them), the reference computation (CANN's golden
reference) and the ``torch.library`` op graph capture sees."""

from __future__ import annotations

import itertools
import math
from typing import Any

import attrs
import torch

from hal.backends.npu.emulator.errors import fail

INT_MAX = 2147483647
TEMPLATE_MASK_SIZE = 2048  # sparse modes 2/3/4 take this "compressed" template mask

# input_layout -> query.dim()
_LAYOUT_QUERY_DIM = {
    "BSH": 3, "BSND": 4, "BNSD": 4, "TND": 3, "NTD": 3, "NSD": 3,
    "BNSD_BSND": 4, "BSH_BNSD": 3, "BSND_BNSD": 4,
    "BSH_NBSD": 3, "BSND_NBSD": 4, "BNSD_NBSD": 4, "TND_NTD": 3, "NTD_TND": 3,
}  # fmt: skip
_TND_FAMILY = ("TND", "NTD", "TND_NTD", "NTD_TND")
_COMPUTED_LAYOUTS = ("TND", "BSND")
_SINK_LAYOUTS = ("TND", "NTD_TND")
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_QUERY_DTYPES = (torch.float16, torch.bfloat16)
# The op's limits, written from the op's documentation independently of the backend's own copy in
# hal.backends.npu.attention: the emulator stands in for the vendor op, so a wrong limit in the
# backend shows up as a refused call here instead of agreeing with itself.
# (qk head dim, v head dim) pairs TND accepts without rope.
TND_HEAD_DIMS = frozenset({(128, 128), (192, 128), (192, 192)})
# The newer documentation: "GQA and PA do not support V_D = 192" (paged KV is the only emulated path).
PAGED_GQA_FORBIDDEN_V_HEAD_DIM = 192
SINK_QK_HEAD_DIMS = frozenset({64, 128, 192})
MAX_SINK_V_HEAD_DIM = 128
MAX_TND_BATCH = 4096
MAX_BATCH = 65536
MAX_GQA_RATIO = 64
MAX_HEADS = 256
MAX_KV_HIDDEN = 65535
_UNEMULATED_TENSORS = (
    "pse_shift", "dequant_scale_query", "dequant_scale_key", "dequant_offset_key", "dequant_scale_value",
    "dequant_offset_value", "dequant_scale_key_rope", "quant_scale_out", "quant_offset_out",
)  # fmt: skip
_UNEMULATED_DTYPES = (
    "query_dtype", "key_dtype", "value_dtype", "query_rope_dtype", "key_rope_dtype", "key_shared_prefix_dtype",
    "value_shared_prefix_dtype", "dequant_scale_query_dtype", "dequant_scale_key_dtype",
    "dequant_scale_value_dtype", "dequant_scale_key_rope_dtype",
)  # fmt: skip

_FIA_SCHEMA = (
    "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, "
    "Tensor? query_rope=None, Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, "
    "SymInt[]? actual_seq_qlen=None, SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, "
    "Tensor? dequant_scale_query=None, Tensor? dequant_scale_key=None, Tensor? dequant_offset_key=None, "
    "Tensor? dequant_scale_value=None, Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, "
    "Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, Tensor? learnable_sink=None, "
    "int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, "
    "int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout=\"BSH\", int sparse_mode=0, "
    "int block_size=0, int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, "
    "int inner_precise=0, bool return_softmax_lse=False, "
    + ", ".join(f"int? {name}=None" for name in _UNEMULATED_DTYPES)
    + ") -> (Tensor, Tensor)"
)


@attrs.frozen
class FiaPlan:
    """What a validated FIA v2 call computes (TND, paged KV)."""

    layout: str  # "TND" or "BSND"
    query_s: int  # BSND: the query's S axis (TND: the longest request)
    q_starts: tuple[int, ...] | None  # TND: per request, into the query's T axis
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    block_size: int
    cache_4d: bool  # (blocks, N_kv, block_size, D) instead of (blocks, block_size, N_kv * D)
    sparse_mode: int
    pre_tokens: int
    next_tokens: int
    softmax_scale: float
    return_softmax_lse: bool


_template_checked: dict[tuple[int, int, torch.dtype, torch.device], bool] = {}


def _check_template_mask(mask: torch.Tensor) -> None:
    # An inference tensor (made under torch.inference_mode, as engines build their kernels) has no
    # version counter: it is checked on every call instead of once per version.
    version = -1 if mask.is_inference() else mask._version
    key = (mask.data_ptr(), version, mask.dtype, mask.device)
    if key not in _template_checked or version < 0:
        plane = mask.reshape(TEMPLATE_MASK_SIZE, TEMPLATE_MASK_SIZE) != 0
        expect = torch.ones(TEMPLATE_MASK_SIZE, TEMPLATE_MASK_SIZE, dtype=torch.bool, device=mask.device).triu(1)
        if len(_template_checked) > 64:
            _template_checked.clear()
        _template_checked[key] = bool(torch.equal(plane, expect))
    if not _template_checked[key]:
        fail(
            "atten_mask for sparse_mode 2/3/4 must be the 2048x2048 template triu(ones, diagonal=1) "
            "(True/1 = masked above the diagonal); the kernel builds the real pattern from the lengths"
        )


def _int_list(name: str, value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            fail(f"{name} must be a list of ints or a 1-D tensor, got a {value.dim()}-D tensor")
        return [int(x) for x in value.tolist()]
    return [int(x) for x in value]


def _per_batch(name: str, value: Any, batch: int, limit: int | None) -> list[int]:
    """Non-TND per-batch lengths: one entry (broadcast) or at least B (the first B used), each in
    ``0..limit`` (the tensor's S, when there is one)."""
    lengths = _int_list(name, value)
    if len(lengths) == 1:
        lengths = lengths * batch
    elif len(lengths) < batch:
        fail(f"{name} has {len(lengths)} entries: non-TND lengths need 1 or at least B={batch}")
    lengths = lengths[:batch]
    if any(x < 0 for x in lengths):
        fail(f"{name} must not contain negative values, got {lengths}")
    if limit is not None and any(x > limit for x in lengths):
        fail(f"{name} entries must be <= the tensor's S={limit}, got {lengths}")
    return lengths


def _check_explicit_mask(
    mask: torch.Tensor, batch: int, query_s: int, table_width: int, block_size: int, kv_lens: list[int], *, single_row: bool
) -> None:
    """An explicit mask (sparse_mode 0/1, or any mode with a one-row query outside TND): shape
    (B or 1, Q_S, KV_S) or (B or 1, 1, Q_S, KV_S) (with one query row also (B, KV_S)), KV_S at least
    maxBlockNumPerSeq * block_size with paged attention."""
    shape = tuple(mask.shape)
    if mask.dim() == 2 and not single_row:
        fail(f"a 2-D atten_mask (Q_S, KV_S) is accepted on 910B only; give (B or 1, Q_S, KV_S) or "
             f"(B or 1, 1, Q_S, KV_S), got {shape}")
    if mask.dim() == 2:
        rows, batch_dim, heads = 1, shape[0], 1
    elif mask.dim() == 3:
        batch_dim, rows, heads = shape[0], shape[1], 1
    else:
        batch_dim, heads, rows = shape[0], shape[1], shape[2]
    if batch_dim not in (1, batch) or heads != 1:
        fail(f"atten_mask of shape {shape}: its batch dim must be 1 or B={batch} and its head dim 1")
    if rows < query_s:
        fail(f"atten_mask of shape {shape}: its query dim must be >= Q_S={query_s}")
    need = max(-(-n // block_size) for n in kv_lens) * block_size
    if shape[-1] < need:
        fail(f"atten_mask of shape {shape}: with Page Attention its last dim must be >= maxBlockNumPerSeq * "
             f"block_size = {need}")


def check_fia_v2(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> FiaPlan:
    """Validate one FIA v2 call the way the op-plugin adapter and CANN checkers do; return its plan.

    The rules run in the order the op checks them, each a named check below: layout and heads,
    what the emulator does not implement, dtypes and devices, the mask options, the sink, the query
    lengths of the layout, the paged KV (lengths, block table, block size, cache shapes), the head
    dims, and the mask against the layout."""
    layout = kw.get("input_layout", "BSH")
    n_q, n_kv = _check_layout_and_heads(query, layout, kw)
    _refuse_unemulated(kw)
    block_table = kw.get("block_table")
    _check_dtypes_and_devices(query, key, value, paged=block_table is not None, kw=kw)
    sparse_mode, mask, pre, nxt = _check_mask_options(query, layout, kw)
    inner_precise, sink = _check_sink_options(n_q, layout, kw)
    b, query_s, q_lens, q_starts, d = _query_lengths(query, layout, n_q, kw)
    if block_table is None:
        raise NotImplementedError("the torch_npu emulator computes paged attention (block_table given) only")
    kv_lens = _check_kv_lengths_and_block_table(block_table, layout, b, kw)
    block_size = _check_block_size(block_table, kw, d, max(q_lens), kv_lens)
    dv, cache_4d = _check_cache_shapes(key, value, n_kv, block_size, d)
    _check_head_dims(layout, n_kv, d, dv, sink)
    _check_mask_for_layout(layout, sparse_mode, mask, inner_precise, query_s, b, block_table, block_size, q_lens, kv_lens)
    return FiaPlan(
        layout=layout,
        query_s=query_s,
        q_starts=q_starts,
        q_lens=q_lens,
        kv_lens=tuple(kv_lens),
        num_q_heads=n_q,
        num_kv_heads=n_kv,
        head_dim=d,
        v_head_dim=dv,
        block_size=block_size,
        cache_4d=cache_4d,
        sparse_mode=sparse_mode,
        pre_tokens=pre,
        next_tokens=nxt,
        softmax_scale=float(kw.get("softmax_scale", 1.0)),
        return_softmax_lse=bool(kw.get("return_softmax_lse", False)),
    )


def _check_layout_and_heads(query: torch.Tensor, layout: str, kw: dict[str, Any]) -> tuple[int, int]:
    """The layout is one the op takes and the query's rank fits it; the head counts fit GQA's limits."""
    if layout not in _LAYOUT_QUERY_DIM:
        fail(f"layout only support {', '.join(_LAYOUT_QUERY_DIM)}; got input_layout={layout!r}")
    if query.dim() != _LAYOUT_QUERY_DIM[layout]:
        fail(
            f"query's dim should be consistent with that of Layout: input_layout={layout!r} needs "
            f"{_LAYOUT_QUERY_DIM[layout]}-D, got query of shape {tuple(query.shape)}"
        )
    n_q = int(kw.get("num_query_heads", 1))
    n_kv = int(kw.get("num_key_value_heads", 0)) or n_q
    if n_q <= 0:
        fail(f"num_query_heads must be > 0, got {n_q}")
    if n_kv < 0 or n_q % n_kv:
        fail(f"num_query_heads={n_q} must be a multiple of num_key_value_heads={n_kv}")
    if n_q // n_kv > MAX_GQA_RATIO:
        fail(f"num_query_heads / num_key_value_heads = {n_q // n_kv} exceeds {MAX_GQA_RATIO}")
    if n_q > MAX_HEADS:
        fail(f"num_query_heads={n_q} exceeds {MAX_HEADS}")
    return n_q, n_kv


def _refuse_unemulated(kw: dict[str, Any]) -> None:
    """Options the op takes and the emulator does not compute raise ``NotImplementedError``."""
    if (kw.get("query_rope") is None) != (kw.get("key_rope") is None):
        fail("query_rope and key_rope must be given together")
    for name in ("query_rope", *_UNEMULATED_TENSORS, *_UNEMULATED_DTYPES):
        if kw.get(name) is not None:
            raise NotImplementedError(f"the torch_npu emulator does not implement FIA v2 {name}")
    for name in ("query_quant_mode", "key_quant_mode", "value_quant_mode"):
        if kw.get(name, 0) != 0:
            raise NotImplementedError(f"the torch_npu emulator does not implement FIA v2 {name}={kw[name]}")


def _check_dtypes_and_devices(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, paged: bool, kw: dict[str, Any]) -> None:
    """One half-precision dtype for q, k and v; every tensor on one device; q, k, v contiguous."""
    if query.dtype == torch.int8 and paged:
        fail("Page Attention does not support an int8 query")
    if query.dtype not in _QUERY_DTYPES:
        fail(f"query dtype must be float16 or bfloat16 (non-quantised FIA), got {query.dtype}")
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            fail(f"{name} dtype {x.dtype} must equal the query dtype {query.dtype} without quantisation")
    tensors = {"query": query, "key": key, "value": value}
    tensors.update({n: kw[n] for n in ("atten_mask", "block_table", "learnable_sink") if kw.get(n) is not None})
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        fail(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    for name in ("query", "key", "value"):
        if not tensors[name].is_contiguous():  # the op's documentation: non-contiguous tensors are not supported
            fail(f"{name} must be contiguous (FIA v2 does not support non-contiguous tensors), got strides {tensors[name].stride()}")


def _check_mask_options(query: torch.Tensor, layout: str, kw: dict[str, Any]) -> tuple[int, torch.Tensor | None, int, int]:
    """``sparse_mode``, ``atten_mask`` (the template mask in modes 2-4), ``pre_tokens`` and ``next_tokens``."""
    sparse_mode = int(kw.get("sparse_mode", 0))
    mask = kw.get("atten_mask")
    if sparse_mode in (5, 6, 7, 8):
        fail(f"sparse_mode={sparse_mode} (prefix/global/dilated/block_local) is not supported by FIA")
    if sparse_mode not in (0, 1, 2, 3, 4):
        fail(f"sparse_mode must be in 0..4, got {sparse_mode}")
    if sparse_mode != 0 and mask is None:
        fail(f"atten_mask should not be null when sparse_mode={sparse_mode}")
    if mask is not None:
        if mask.dtype not in _MASK_DTYPES:
            fail(f"atten_mask dtype must be bool, int8 or uint8, got {mask.dtype}")
        if mask.dim() not in (2, 3, 4):
            fail(f"atten_mask must be 2-, 3- or 4-D, got shape {tuple(mask.shape)}")
        # a one-row query outside TND takes its mask as is, whatever the mode
        one_row = layout == "BSND" and query.dim() == 4 and query.shape[1] == 1
        if sparse_mode in (2, 3, 4) and not one_row:
            ok = tuple(mask.shape) in (
                (TEMPLATE_MASK_SIZE,) * 2, (1, *(TEMPLATE_MASK_SIZE,) * 2), (1, 1, *(TEMPLATE_MASK_SIZE,) * 2)
            )  # fmt: skip
            if not ok:
                fail(
                    f"sparse_mode={sparse_mode} needs a (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048) "
                    f"atten_mask, got {tuple(mask.shape)}"
                )
            _check_template_mask(mask)
    pre, nxt = int(kw.get("pre_tokens", INT_MAX)), int(kw.get("next_tokens", INT_MAX))
    if pre + nxt < 0:
        fail(
            f"Nexttoken line should be higher than pretoken line: pre_tokens={pre} + next_tokens={nxt} must be >= 0"
        )
    return sparse_mode, mask, pre, nxt


def _check_sink_options(n_q: int, layout: str, kw: dict[str, Any]) -> tuple[int, torch.Tensor | None]:
    """``inner_precise``, and ``learnable_sink``'s dtype, shape, layout and precision."""
    inner_precise = int(kw.get("inner_precise", 0))
    if inner_precise not in (0, 1, 2, 3):
        fail(f"inner_precise must be in 0..3, got {inner_precise}")
    sink = kw.get("learnable_sink")
    if sink is not None:
        if sink.dtype != torch.bfloat16:
            fail(f"learnable_sink must be bfloat16, got {sink.dtype}")
        if tuple(sink.shape) != (n_q,):
            fail(f"learnable_sink must have shape (num_query_heads,) = ({n_q},), got {tuple(sink.shape)}")
        if layout not in _SINK_LAYOUTS:
            fail(f"learnable_sink is only supported with input_layout TND or NTD_TND, got {layout!r}")
        if inner_precise != 0:
            fail(f"learnable_sink needs inner_precise=0 (high precision), got {inner_precise}")
    return inner_precise, sink


def _query_lengths(
    query: torch.Tensor, layout: str, n_q: int, kw: dict[str, Any]
) -> tuple[int, int, tuple[int, ...], tuple[int, ...] | None, int]:
    """The batch, the longest query, each request's query length (and its start in TND) and the qk
    head dim, as the layout gives them: cumulative ``actual_seq_qlen`` in TND, per request in BSND."""
    if layout not in _COMPUTED_LAYOUTS:
        raise NotImplementedError(f"the torch_npu emulator computes input_layout {_COMPUTED_LAYOUTS} only, got {layout!r}")
    if layout == "TND":
        if query.shape[1] != n_q:
            fail(f"TND query has {query.shape[1]} heads but num_query_heads={n_q}")
        t, d = query.shape[0], query.shape[2]
        if kw.get("actual_seq_qlen") is None:
            fail("input_layout TND requires actual_seq_qlen (cumulative query end offsets)")
        q_cum = _int_list("actual_seq_qlen", kw["actual_seq_qlen"])
        b = len(q_cum)
        if b == 0 or b > MAX_TND_BATCH:
            fail(f"TND actual_seq_qlen must have 1..{MAX_TND_BATCH} entries, got {b}")
        if any(x < 0 for x in q_cum):
            fail(f"actual_seq_qlen must not contain negative values, got {q_cum}")
        if any(later < earlier for earlier, later in itertools.pairwise(q_cum)):
            fail(
                f"TND actual_seq_qlen must be cumulative (non-decreasing prefix-sum end offsets), got {q_cum}; "
                "per-request lengths are not accepted in TND"
            )
        if q_cum[-1] != t:
            fail(f"TND actual_seq_qlen[-1]={q_cum[-1]} must equal the query's T={t} (sum of query lengths)")
        starts = (0, *q_cum[:-1])
        q_lens = tuple(e - s for s, e in zip(starts, q_cum))
        return b, max(q_lens), q_lens, starts, d
    # BSND: (B, S, N_q, D), per-batch lengths
    b, query_s, heads, d = query.shape
    if heads != n_q:
        fail(f"BSND query has {heads} heads but num_query_heads={n_q}")
    if b == 0 or b > MAX_BATCH:
        fail(f"BSND query batch must be in 1..{MAX_BATCH}, got {b}")
    if query_s == 1 or kw.get("actual_seq_qlen") is None:  # Q_S == 1: actual_seq_qlen is ignored
        return b, query_s, (query_s,) * b, None, d
    return b, query_s, tuple(_per_batch("actual_seq_qlen", kw["actual_seq_qlen"], b, query_s)), None, d


def _check_kv_lengths_and_block_table(block_table: torch.Tensor, layout: str, b: int, kw: dict[str, Any]) -> list[int]:
    """Page Attention's ``actual_seq_kvlen`` (one per request) and the block table's dtype and rows."""
    if kw.get("actual_seq_kvlen") is None:
        fail("Page Attention requires actual_seq_kvlen (per-request KV lengths)")
    if layout == "TND":
        kv_lens = _int_list("actual_seq_kvlen", kw["actual_seq_kvlen"])
        if len(kv_lens) != b:
            fail(f"actual_seq_kvlen has {len(kv_lens)} entries, actual_seq_qlen defines B={b}")
        if any(x < 0 for x in kv_lens):
            fail(f"actual_seq_kvlen must not contain negative values, got {kv_lens}")
    else:
        kv_lens = _per_batch("actual_seq_kvlen", kw["actual_seq_kvlen"], b, None)
    if block_table.dtype != torch.int32:
        fail(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or 0 in block_table.shape:
        fail(f"block_table must be 2-D without a 0 dim, got shape {tuple(block_table.shape)}")
    if block_table.shape[0] != b:
        fail(f"block_table has {block_table.shape[0]} rows for B={b}")
    return kv_lens


def _check_block_size(block_table: torch.Tensor, kw: dict[str, Any], d: int, max_q: int, kv_lens: list[int]) -> int:
    """``block_size`` by the rule for the head dim and query length, and enough block-table columns."""
    block_size = int(kw.get("block_size", 0))
    if block_size <= 0:
        fail(f"block_size must be > 0 with Page Attention, got {block_size}")
    if d in (64, 128):
        rule, ok = "a multiple of 16 in [16, 1024]", block_size % 16 == 0 and block_size <= 1024
    elif max_q > 1:
        rule, ok = "a multiple of 128 in [128, 512]", block_size % 128 == 0 and block_size <= 512
    else:
        rule, ok = "a multiple of 16 in [16, 512]", block_size % 16 == 0 and block_size <= 512
    if not ok:
        fail(f"block_size={block_size} is invalid for head dim {d} with query length {max_q}: must be {rule}")
    need_blocks = max(-(-n // block_size) for n in kv_lens)
    if block_table.shape[1] < need_blocks:
        fail(
            f"block_table has {block_table.shape[1]} columns, fewer than maxBlockNumPerSeq={need_blocks} "
            f"(max actual_seq_kvlen {max(kv_lens)} / block_size {block_size})"
        )
    return block_size


def _check_cache_shapes(key: torch.Tensor, value: torch.Tensor, n_kv: int, block_size: int, d: int) -> tuple[int, bool]:
    """The paged K and V caches, 3-D ``(blocks, block_size, N_kv * D)`` or 4-D ``(blocks, N_kv,
    block_size, D)``; returns the v head dim and whether the cache is 4-D."""
    if value.dim() not in (3, 4, 5):
        fail(f"when Page Attention enabled, value's dim should be 3/4/5, got shape {tuple(value.shape)}")
    if key.dim() != value.dim():
        fail(f"key and value caches must have the same rank, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.dim() == 5:
        raise NotImplementedError("the torch_npu emulator does not implement the 5-D NZ KV cache")
    if key.dim() == 4:
        want_k = (key.shape[0], n_kv, block_size, d)
        if tuple(key.shape) != want_k:
            fail(f"4-D key cache must be (blocks, N_kv={n_kv}, block_size={block_size}, D={d}), got {tuple(key.shape)}")
        if tuple(value.shape[:3]) != want_k[:3]:
            fail(f"4-D value cache must be (blocks, {n_kv}, {block_size}, Dv), got {tuple(value.shape)}")
        return value.shape[3], True
    if key.shape[1] != block_size or key.shape[2] != n_kv * d:
        fail(
            f"3-D key cache must be (blocks, block_size={block_size}, N_kv*D={n_kv * d}), got {tuple(key.shape)}"
        )
    if value.shape[0] != key.shape[0] or value.shape[1] != block_size or value.shape[2] % n_kv:
        fail(
            f"3-D value cache must be ({key.shape[0]}, block_size={block_size}, N_kv*Dv), got {tuple(value.shape)}"
        )
    return value.shape[2] // n_kv, False


def _check_head_dims(layout: str, n_kv: int, d: int, dv: int, sink: torch.Tensor | None) -> None:
    """The (qk, v) head dims the layout documents, the KV hidden size, and the sink's head-dim limits."""
    if n_kv * d > MAX_KV_HIDDEN:
        fail(f"N_kv * D = {n_kv * d} exceeds {MAX_KV_HIDDEN}")
    if (d, dv) not in TND_HEAD_DIMS:
        # Documented for TND; BSND is held to the same pairs (the strict side: its paged limits for qk != v
        # are not documented beyond them).
        fail(
            f"{layout} without rope needs (qk, v) head dims in {sorted(TND_HEAD_DIMS)}, got ({d}, {dv})"
        )
    if sink is not None:
        if d not in SINK_QK_HEAD_DIMS:
            fail(f"learnable_sink needs a qk head dim in {sorted(SINK_QK_HEAD_DIMS)}, got {d}")
        if dv > MAX_SINK_V_HEAD_DIM:
            fail(f"learnable_sink needs a v head dim <= {MAX_SINK_V_HEAD_DIM}, got {dv}")
    if dv == PAGED_GQA_FORBIDDEN_V_HEAD_DIM:
        # Documented ("GQA and PA do not support V_D = 192"), not confirmed on hardware: refused, the strict side.
        fail(f"paged attention (GQA/PA) does not support a v head dim of {dv}")


def _check_mask_for_layout(
    layout: str, sparse_mode: int, mask: torch.Tensor | None, inner_precise: int, query_s: int, b: int,
    block_table: torch.Tensor, block_size: int, q_lens: tuple[int, ...], kv_lens: list[int],
) -> None:
    """The modes TND takes, an explicit mask's shape against the batch, and mode 3's per-request lengths in TND."""
    if layout == "TND" and (sparse_mode in (1, 2) or (sparse_mode == 0 and mask is not None)):
        fail(f"input_layout TND supports sparse_mode 0 (no mask), 3 or 4, got {sparse_mode} (mask given: {mask is not None})")
    if layout != "TND" and query_s == 1:
        if inner_precise not in (0, 1):
            fail(f"inner_precise must be 0 or 1 when the query length is 1, got {inner_precise}")
        if mask is not None:  # applied as is; sparse_mode, pre_tokens and next_tokens are ignored
            _check_explicit_mask(mask, b, 1, block_table.shape[1], block_size, kv_lens, single_row=True)
    elif sparse_mode in (0, 1) and mask is not None:
        _check_explicit_mask(mask, b, query_s, block_table.shape[1], block_size, kv_lens, single_row=False)
    if sparse_mode == 3 and layout == "TND":
        bad = [i for i, (q, kv) in enumerate(zip(q_lens, kv_lens)) if q > kv]
        if bad:
            i = bad[0]
            fail(
                f"TND with sparse_mode=3 needs actual query length <= actual_seq_kvlen per request; "
                f"request {i} has {q_lens[i]} query tokens and kv length {kv_lens[i]}"
            )


def _allowed_keys(plan: FiaPlan, q_len: int, kv_len: int, mask: torch.Tensor | None, b: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] True where query row i attends key j of batch ``b``: modes 3/4 from the lengths
    (bottom-right origin per request); an explicit mask (True/1 = masked) in modes 0/1, and as is
    for a one-row query outside TND, where the mode is ignored."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    if mask is not None and (plan.sparse_mode in (0, 1) or (plan.layout != "TND" and plan.query_s == 1)):
        plane = mask.reshape(mask.shape[0], -1, mask.shape[-1])[min(b, mask.shape[0] - 1)]  # (Q_S, KV_S)
        allowed = plane[:q_len, :kv_len] == 0
        if plan.sparse_mode == 0 and not (plan.layout != "TND" and plan.query_s == 1):
            allowed = allowed & (j >= i - plan.pre_tokens) & (j <= i + plan.next_tokens)  # band, top-left origin
        return allowed
    if plan.layout != "TND" and plan.query_s == 1:
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    diag = i + (kv_len - q_len)
    if plan.sparse_mode == 3:
        return j <= diag
    if plan.sparse_mode == 4:
        return (j >= diag - plan.pre_tokens) & (j <= diag + plan.next_tokens)
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)


def fia_v2_reference(
    plan: FiaPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_table: torch.Tensor,
    learnable_sink: torch.Tensor | None,
    atten_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CANN golden for one validated call: per request, fp32 math, output in the query dtype
    (TND rows packed; BSND rows past a batch's actual length stay 0)."""
    n_q, n_kv, d, dv, bs = plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.v_head_dim, plan.block_size
    group = n_q // n_kv
    # Work on packed rows: BSND's (B, S) flattened, request b's rows starting at b * S.
    rows = query.reshape(-1, n_q, d)
    starts = plan.q_starts if plan.q_starts is not None else tuple(b * plan.query_s for b in range(len(plan.q_lens)))
    out = torch.zeros((rows.shape[0], n_q, dv), dtype=query.dtype, device=query.device)
    lse = torch.full((rows.shape[0], n_q, 1), math.inf, dtype=torch.float32, device=query.device)
    if plan.cache_4d:
        k_cache, v_cache = key.transpose(1, 2), value.transpose(1, 2)  # -> (blocks, bs, N_kv, D)
    else:
        k_cache = key.reshape(key.shape[0], bs, n_kv, d)
        v_cache = value.reshape(value.shape[0], bs, n_kv, dv)
    sink = None if learnable_sink is None else learnable_sink.float()
    for b, (start, q_len, kv_len) in enumerate(zip(starts, plan.q_lens, plan.kv_lens)):
        if q_len == 0 or kv_len == 0:
            continue  # no query rows, or no keys: output stays 0
        n_blocks = -(-kv_len // bs)
        blocks = block_table[b, :n_blocks].long()
        keys = k_cache[blocks].reshape(n_blocks * bs, n_kv, d)[:kv_len].float()
        values = v_cache[blocks].reshape(n_blocks * bs, n_kv, dv)[:kv_len].float()
        keys = keys.repeat_interleave(group, dim=1)  # query head h uses kv head h // group
        values = values.repeat_interleave(group, dim=1)
        q = rows[start : start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * plan.softmax_scale
        allowed = _allowed_keys(plan, q_len, kv_len, atten_mask, b, query.device)
        scores = scores.masked_fill(~allowed, -math.inf)
        if sink is not None:  # one extra, unscaled logit per head: only enlarges the denominator
            scores = torch.cat([scores, sink.view(n_q, 1, 1).expand(n_q, q_len, 1)], dim=-1)
        row_max = scores.amax(-1, keepdim=True)
        dead = torch.isinf(row_max) & (row_max < 0)  # fully masked rows (and no sink)
        row_max = torch.where(dead, torch.zeros_like(row_max), row_max)
        weights = torch.exp(scores - row_max)
        denom = weights.sum(-1, keepdim=True)
        probs = weights / torch.where(dead, torch.ones_like(denom), denom)
        ctx = torch.einsum("hqk,khd->qhd", probs[..., :kv_len], values)
        out[start : start + q_len] = ctx.to(query.dtype)
        row_lse = torch.where(dead, torch.full_like(denom, math.inf), row_max + torch.log(denom))
        lse[start : start + q_len] = row_lse.permute(1, 0, 2)
    if plan.layout == "BSND":
        batch = len(plan.q_lens)
        out = out.view(batch, plan.query_s, n_q, dv)
        lse = lse.view(batch, plan.query_s, n_q, 1).transpose(1, 2)  # (B, N_q, Q_S, 1)
    if not plan.return_softmax_lse:
        lse = torch.empty(0, dtype=torch.float32, device=query.device)
    return out, lse


def _fia_v2_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    plan = check_fia_v2(query, key, value, **kw)
    return fia_v2_reference(plan, query, key, value, kw["block_table"], kw.get("learnable_sink"), kw.get("atten_mask"))


_OP_NAMESPACE = "hal_npu_emulator"
_LIBRARY = torch.library.Library(_OP_NAMESPACE, "DEF")
_LIBRARY.define(_FIA_SCHEMA)
_LIBRARY.impl("npu_fused_infer_attention_score_v2", _fia_v2_kernel, "CompositeExplicitAutograd")
FIA_V2 = getattr(torch.ops, _OP_NAMESPACE).npu_fused_infer_attention_score_v2
HANDLED_OPS = frozenset({FIA_V2.default})
