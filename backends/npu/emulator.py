"""A strict, pure-torch CPU stand-in for the torch_npu surface ``backends.npu`` uses.

``install()`` puts a fake ``torch_npu`` module into ``sys.modules`` and its ``npu`` submodule at
``torch.npu``; ``uninstall()`` reverts both. Nothing is installed implicitly: tests and
``hal.get_backend("npu", emulate=True)`` ask for it.

What it provides (and nothing more):

* ``torch_npu.npu_fused_infer_attention_score_v2`` (FIA v2), a ``torch.library`` op so graph capture
  sees it as one call with its host list arguments. It **rejects what the real op rejects**
  (the checklist of ``npu_ops_spec.md`` §1.12) with :class:`NpuOpError`, and computes the documented
  result (§1.7-1.9) for the TND layout with a paged KV cache, the form the backend uses. Other
  layouts, rope, pse, quantisation and NZ caches pass the checks but raise ``NotImplementedError``.
* ``torch_npu.npu_scatter_nd_update_`` (in place, §2.1), with its shape/dtype rules.
* ``torch.npu``: ``NPUGraph``, ``graph(...)``, ``graph_pool_handle``, ``synchronize``, ``Stream``,
  ``current_stream``, ``stream``, ``is_available``, ``device_count``, ``current_device``.

The NPUGraph stand-in records every aten op run during capture (a ``TorchDispatchMode``) and replays
that op list into the same output tensors: view ops are skipped (their outputs already alias), ops
that write their arguments are re-run, functional results are copied into the recorded outputs. So
device buffers are read at replay time while host arguments stay baked at capture-time values unless
``update()`` replaces them -- the real hazard. With ``auto_dispatch_capture=True`` each FIA call is a
*handled* op: like the real ``ExternalEvent``, replay waits at it until ``update()`` has re-issued it,
so a replay without an update fails instead of hanging as the device would.

Strictness beyond "compute the right numbers":

* a host synchronisation inside capture (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``,
  ``bool(tensor)``, data-dependent output shapes such as ``nonzero``) raises :class:`CaptureSyncError`
  ("Not allow to synchronize captured-stream"), as the runtime does;
* ``update()`` while a previous replay of the graph has not been synchronised raises
  :class:`NpuOpError` (on the device the update would rewrite the parameters of tasks still running);
* ``update()`` re-validates every re-issued op with its new host arguments, as the real re-issue does;
  a failed re-issue keeps the op's previous arguments and aborts the waiting replay.

Decisions on the points the spec marks [UNCONFIRMED] (all on the strict side):

* TND ``actual_seq_qlen[-1]`` must equal ``T`` (the query's first dim).
* TND with ``sparse_mode=3`` needs ``q_len <= kv_len`` per request (the older doc's rule); sparse
  modes allowed in TND are 0 (no mask), 3 and 4.
* The 2048x2048 template mask must be exactly ``triu(ones, diagonal=1)`` (True = masked).
* qk head dim != v head dim with paged attention is accepted (A2/A3 behaviour that sglang's MiMo-V2
  path relies on), in sparse modes 3 and 4; the TND head-dim rule (128/128, 192/128, 192/192) applies.
* ``learnable_sink`` counts in the returned ``softmax_lse``; fully masked rows give output 0 and
  ``lse = +inf`` (the CANN golden; the hardware may differ when ``inner_precise`` lacks bit 1).
* Tensor-typed ``actual_seq_*`` arguments are read by torch's argument parser (a device read: inside
  a capture that is a host sync and raises).
* ``npu_scatter_nd_update_`` with duplicate indices: last write wins (undefined on the device).
* Block ids are not validated by the real op; the emulator only gathers the blocks a request needs
  and torch raises ``IndexError`` for ids outside the cache.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import itertools
import math
import sys
import threading
import time
import types
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CaptureSyncError",
    "NPUGraph",
    "NpuOpError",
    "Stream",
    "emulated",
    "install",
    "is_installed",
    "uninstall",
]

INT_MAX = 2147483647
TEMPLATE_MASK_SIZE = 2048  # sparse modes 2/3/4 take this "compressed" template mask
# Seconds a replay waits at a handled op for its update before failing (a real device would hang).
REPLAY_WAIT_TIMEOUT_S = 30.0
SYNC_IN_CAPTURE = "Not allow to synchronize captured-stream"


class NpuOpError(RuntimeError):
    """An emulated torch_npu call was given arguments the real op or runtime rejects."""


class CaptureSyncError(NpuOpError):
    """A host synchronisation (reading device data on the host) happened inside a graph capture."""


def _fail(message: str) -> None:
    raise NpuOpError(message)


# ---------------------------------------------------------------------------------------------
# FIA v2: argument checks (§1.3-1.7, §1.9, §1.10, §1.12) and the reference computation (§1.8)
# ---------------------------------------------------------------------------------------------

# input_layout -> query.dim()
_LAYOUT_QUERY_DIM = {
    "BSH": 3, "BSND": 4, "BNSD": 4, "TND": 3, "NTD": 3, "NSD": 3,
    "BNSD_BSND": 4, "BSH_BNSD": 3, "BSND_BNSD": 4,
    "BSH_NBSD": 3, "BSND_NBSD": 4, "BNSD_NBSD": 4, "TND_NTD": 3, "NTD_TND": 3,
}  # fmt: skip
_TND_FAMILY = ("TND", "NTD", "TND_NTD", "NTD_TND")
_SINK_LAYOUTS = ("TND", "NTD_TND")
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_QUERY_DTYPES = (torch.float16, torch.bfloat16)
# (qk head dim, v head dim) pairs TND accepts without rope (§1.10).
TND_HEAD_DIMS = frozenset({(128, 128), (192, 128), (192, 192)})
SINK_QK_HEAD_DIMS = frozenset({64, 128, 192})
MAX_SINK_V_HEAD_DIM = 128
MAX_TND_BATCH = 4096
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

    q_starts: tuple[int, ...]  # per request, into the query's T axis
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
    key = (mask.data_ptr(), mask._version, mask.dtype, mask.device)
    if key not in _template_checked:
        plane = mask.reshape(TEMPLATE_MASK_SIZE, TEMPLATE_MASK_SIZE) != 0
        expect = torch.ones(TEMPLATE_MASK_SIZE, TEMPLATE_MASK_SIZE, dtype=torch.bool, device=mask.device).triu(1)
        if len(_template_checked) > 64:
            _template_checked.clear()
        _template_checked[key] = bool(torch.equal(plane, expect))
    if not _template_checked[key]:
        _fail(
            "atten_mask for sparse_mode 2/3/4 must be the 2048x2048 template triu(ones, diagonal=1) "
            "(True/1 = masked above the diagonal); the kernel builds the real pattern from the lengths"
        )


def _int_list(name: str, value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            _fail(f"{name} must be a list of ints or a 1-D tensor, got a {value.dim()}-D tensor")
        return [int(x) for x in value.tolist()]
    return [int(x) for x in value]


def check_fia_v2(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> FiaPlan:
    """Validate one FIA v2 call the way the op-plugin adapter and CANN checkers do; return its plan."""
    layout = kw.get("input_layout", "BSH")
    if layout not in _LAYOUT_QUERY_DIM:
        _fail(f"layout only support {', '.join(_LAYOUT_QUERY_DIM)}; got input_layout={layout!r}")
    if query.dim() != _LAYOUT_QUERY_DIM[layout]:
        _fail(
            f"query's dim should be consistent with that of Layout: input_layout={layout!r} needs "
            f"{_LAYOUT_QUERY_DIM[layout]}-D, got query of shape {tuple(query.shape)}"
        )
    n_q = int(kw.get("num_query_heads", 1))
    n_kv = int(kw.get("num_key_value_heads", 0)) or n_q
    if n_q <= 0:
        _fail(f"num_query_heads must be > 0, got {n_q}")
    if n_kv < 0 or n_q % n_kv:
        _fail(f"num_query_heads={n_q} must be a multiple of num_key_value_heads={n_kv}")
    if n_q // n_kv > MAX_GQA_RATIO:
        _fail(f"num_query_heads / num_key_value_heads = {n_q // n_kv} exceeds {MAX_GQA_RATIO}")
    if n_q > MAX_HEADS:
        _fail(f"num_query_heads={n_q} exceeds {MAX_HEADS}")

    if (kw.get("query_rope") is None) != (kw.get("key_rope") is None):
        _fail("query_rope and key_rope must be given together")
    for name in ("query_rope", *_UNEMULATED_TENSORS, *_UNEMULATED_DTYPES):
        if kw.get(name) is not None:
            raise NotImplementedError(f"the torch_npu emulator does not implement FIA v2 {name}")
    for name in ("query_quant_mode", "key_quant_mode", "value_quant_mode"):
        if kw.get(name, 0) != 0:
            raise NotImplementedError(f"the torch_npu emulator does not implement FIA v2 {name}={kw[name]}")

    block_table = kw.get("block_table")
    paged = block_table is not None
    if query.dtype == torch.int8 and paged:
        _fail("Page Attention does not support an int8 query")
    if query.dtype not in _QUERY_DTYPES:
        _fail(f"query dtype must be float16 or bfloat16 (non-quantised FIA), got {query.dtype}")
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            _fail(f"{name} dtype {x.dtype} must equal the query dtype {query.dtype} without quantisation")
    tensors = {"query": query, "key": key, "value": value}
    tensors.update({n: kw[n] for n in ("atten_mask", "block_table", "learnable_sink") if kw.get(n) is not None})
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        _fail(f"all tensors must be on one device, got {sorted(map(str, devices))}")

    sparse_mode = int(kw.get("sparse_mode", 0))
    mask = kw.get("atten_mask")
    if sparse_mode in (5, 6, 7, 8):
        _fail(f"sparse_mode={sparse_mode} (prefix/global/dilated/block_local) is not supported by FIA")
    if sparse_mode not in (0, 1, 2, 3, 4):
        _fail(f"sparse_mode must be in 0..4, got {sparse_mode}")
    if sparse_mode != 0 and mask is None:
        _fail(f"atten_mask should not be null when sparse_mode={sparse_mode}")
    if mask is not None:
        if mask.dtype not in _MASK_DTYPES:
            _fail(f"atten_mask dtype must be bool, int8 or uint8, got {mask.dtype}")
        if mask.dim() not in (2, 3, 4):
            _fail(f"atten_mask must be 2-, 3- or 4-D, got shape {tuple(mask.shape)}")
        if sparse_mode in (2, 3, 4):
            ok = tuple(mask.shape) in (
                (TEMPLATE_MASK_SIZE,) * 2, (1, *(TEMPLATE_MASK_SIZE,) * 2), (1, 1, *(TEMPLATE_MASK_SIZE,) * 2)
            )  # fmt: skip
            if not ok:
                _fail(
                    f"sparse_mode={sparse_mode} needs a (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048) "
                    f"atten_mask, got {tuple(mask.shape)}"
                )
            _check_template_mask(mask)
    pre, nxt = int(kw.get("pre_tokens", INT_MAX)), int(kw.get("next_tokens", INT_MAX))
    if pre + nxt < 0:
        _fail(
            f"Nexttoken line should be higher than pretoken line: pre_tokens={pre} + next_tokens={nxt} must be >= 0"
        )

    inner_precise = int(kw.get("inner_precise", 0))
    if inner_precise not in (0, 1, 2, 3):
        _fail(f"inner_precise must be in 0..3, got {inner_precise}")
    sink = kw.get("learnable_sink")
    if sink is not None:
        if sink.dtype != torch.bfloat16:
            _fail(f"learnable_sink must be bfloat16, got {sink.dtype}")
        if tuple(sink.shape) != (n_q,):
            _fail(f"learnable_sink must have shape (num_query_heads,) = ({n_q},), got {tuple(sink.shape)}")
        if layout not in _SINK_LAYOUTS:
            _fail(f"learnable_sink is only supported with input_layout TND or NTD_TND, got {layout!r}")
        if inner_precise != 0:
            _fail(f"learnable_sink needs inner_precise=0 (high precision), got {inner_precise}")

    if layout != "TND":
        raise NotImplementedError(f"the torch_npu emulator computes input_layout='TND' only, got {layout!r}")
    if query.shape[1] != n_q:
        _fail(f"TND query has {query.shape[1]} heads but num_query_heads={n_q}")
    t, d = query.shape[0], query.shape[2]

    if kw.get("actual_seq_qlen") is None:
        _fail("input_layout TND requires actual_seq_qlen (cumulative query end offsets)")
    q_cum = _int_list("actual_seq_qlen", kw["actual_seq_qlen"])
    b = len(q_cum)
    if b == 0 or b > MAX_TND_BATCH:
        _fail(f"TND actual_seq_qlen must have 1..{MAX_TND_BATCH} entries, got {b}")
    if any(x < 0 for x in q_cum):
        _fail(f"actual_seq_qlen must not contain negative values, got {q_cum}")
    if any(later < earlier for earlier, later in itertools.pairwise(q_cum)):
        _fail(
            f"TND actual_seq_qlen must be cumulative (non-decreasing prefix-sum end offsets), got {q_cum}; "
            "per-request lengths are not accepted in TND"
        )
    if q_cum[-1] != t:
        _fail(f"TND actual_seq_qlen[-1]={q_cum[-1]} must equal the query's T={t} (sum of query lengths)")
    q_starts = (0, *q_cum[:-1])
    q_lens = tuple(e - s for s, e in zip(q_starts, q_cum))

    if not paged:
        raise NotImplementedError("the torch_npu emulator computes paged attention (block_table given) only")
    if kw.get("actual_seq_kvlen") is None:
        _fail("Page Attention requires actual_seq_kvlen (per-request KV lengths)")
    kv_lens = _int_list("actual_seq_kvlen", kw["actual_seq_kvlen"])
    if len(kv_lens) != b:
        _fail(f"actual_seq_kvlen has {len(kv_lens)} entries, actual_seq_qlen defines B={b}")
    if any(x < 0 for x in kv_lens):
        _fail(f"actual_seq_kvlen must not contain negative values, got {kv_lens}")
    assert block_table is not None
    if block_table.dtype != torch.int32:
        _fail(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or 0 in block_table.shape:
        _fail(f"block_table must be 2-D without a 0 dim, got shape {tuple(block_table.shape)}")
    if block_table.shape[0] != b:
        _fail(f"block_table has {block_table.shape[0]} rows for B={b}")

    block_size = int(kw.get("block_size", 0))
    max_q = max(q_lens)
    if block_size <= 0:
        _fail(f"block_size must be > 0 with Page Attention, got {block_size}")
    if d in (64, 128):
        rule, ok = "a multiple of 16 in [16, 1024]", block_size % 16 == 0 and block_size <= 1024
    elif max_q > 1:
        rule, ok = "a multiple of 128 in [128, 512]", block_size % 128 == 0 and block_size <= 512
    else:
        rule, ok = "a multiple of 16 in [16, 512]", block_size % 16 == 0 and block_size <= 512
    if not ok:
        _fail(f"block_size={block_size} is invalid for head dim {d} with query length {max_q}: must be {rule}")
    need_blocks = max(-(-n // block_size) for n in kv_lens)
    if block_table.shape[1] < need_blocks:
        _fail(
            f"block_table has {block_table.shape[1]} columns, fewer than maxBlockNumPerSeq={need_blocks} "
            f"(max actual_seq_kvlen {max(kv_lens)} / block_size {block_size})"
        )

    if value.dim() not in (3, 4, 5):
        _fail(f"when Page Attention enabled, value's dim should be 3/4/5, got shape {tuple(value.shape)}")
    if key.dim() != value.dim():
        _fail(f"key and value caches must have the same rank, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.dim() == 5:
        raise NotImplementedError("the torch_npu emulator does not implement the 5-D NZ KV cache")
    cache_4d = key.dim() == 4
    if cache_4d:
        want_k = (key.shape[0], n_kv, block_size, d)
        if tuple(key.shape) != want_k:
            _fail(f"4-D key cache must be (blocks, N_kv={n_kv}, block_size={block_size}, D={d}), got {tuple(key.shape)}")
        if tuple(value.shape[:3]) != want_k[:3]:
            _fail(f"4-D value cache must be (blocks, {n_kv}, {block_size}, Dv), got {tuple(value.shape)}")
        dv = value.shape[3]
    else:
        if key.shape[1] != block_size or key.shape[2] != n_kv * d:
            _fail(
                f"3-D key cache must be (blocks, block_size={block_size}, N_kv*D={n_kv * d}), got {tuple(key.shape)}"
            )
        if value.shape[0] != key.shape[0] or value.shape[1] != block_size or value.shape[2] % n_kv:
            _fail(
                f"3-D value cache must be ({key.shape[0]}, block_size={block_size}, N_kv*Dv), got {tuple(value.shape)}"
            )
        dv = value.shape[2] // n_kv
    if n_kv * d > MAX_KV_HIDDEN:
        _fail(f"N_kv * D = {n_kv * d} exceeds {MAX_KV_HIDDEN}")
    if (d, dv) not in TND_HEAD_DIMS:
        _fail(
            f"TND without rope needs (qk, v) head dims in {sorted(TND_HEAD_DIMS)}, got ({d}, {dv})"
        )
    if sink is not None:
        if d not in SINK_QK_HEAD_DIMS:
            _fail(f"learnable_sink needs a qk head dim in {sorted(SINK_QK_HEAD_DIMS)}, got {d}")
        if dv > MAX_SINK_V_HEAD_DIM:
            _fail(f"learnable_sink needs a v head dim <= {MAX_SINK_V_HEAD_DIM}, got {dv}")
    if sparse_mode in (1, 2) or (sparse_mode == 0 and mask is not None):
        _fail(f"input_layout TND supports sparse_mode 0 (no mask), 3 or 4, got {sparse_mode} (mask given: {mask is not None})")
    if sparse_mode == 3:
        bad = [i for i, (q, kv) in enumerate(zip(q_lens, kv_lens)) if q > kv]
        if bad:
            i = bad[0]
            _fail(
                f"TND with sparse_mode=3 needs actual query length <= actual_seq_kvlen per request; "
                f"request {i} has {q_lens[i]} query tokens and kv length {kv_lens[i]}"
            )
    return FiaPlan(
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


def _allowed_keys(plan: FiaPlan, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] True where query row i attends key j (§1.7, bottom-right origin per request)."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CANN golden for one validated call: per request, fp32 math, output in the query dtype."""
    t = query.shape[0]
    n_q, n_kv, d, dv, bs = plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.v_head_dim, plan.block_size
    group = n_q // n_kv
    out = torch.zeros((t, n_q, dv), dtype=query.dtype, device=query.device)
    lse = torch.full((t, n_q, 1), math.inf, dtype=torch.float32, device=query.device)
    if plan.cache_4d:
        k_cache, v_cache = key.transpose(1, 2), value.transpose(1, 2)  # -> (blocks, bs, N_kv, D)
    else:
        k_cache = key.reshape(key.shape[0], bs, n_kv, d)
        v_cache = value.reshape(value.shape[0], bs, n_kv, dv)
    sink = None if learnable_sink is None else learnable_sink.float()
    for b, (start, q_len, kv_len) in enumerate(zip(plan.q_starts, plan.q_lens, plan.kv_lens)):
        if q_len == 0 or kv_len == 0:
            continue  # no query rows, or no keys: output stays 0
        n_blocks = -(-kv_len // bs)
        blocks = block_table[b, :n_blocks].long()
        keys = k_cache[blocks].reshape(n_blocks * bs, n_kv, d)[:kv_len].float()
        values = v_cache[blocks].reshape(n_blocks * bs, n_kv, dv)[:kv_len].float()
        keys = keys.repeat_interleave(group, dim=1)  # query head h uses kv head h // group
        values = values.repeat_interleave(group, dim=1)
        q = query[start : start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * plan.softmax_scale
        allowed = _allowed_keys(plan, q_len, kv_len, query.device)
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
    if not plan.return_softmax_lse:
        lse = torch.empty(0, dtype=torch.float32, device=query.device)
    return out, lse


def _fia_v2_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    plan = check_fia_v2(query, key, value, **kw)
    return fia_v2_reference(plan, query, key, value, kw["block_table"], kw.get("learnable_sink"))


_OP_NAMESPACE = "hal_npu_emulator"
_LIBRARY = torch.library.Library(_OP_NAMESPACE, "DEF")
_LIBRARY.define(_FIA_SCHEMA)
_LIBRARY.impl("npu_fused_infer_attention_score_v2", _fia_v2_kernel, "CompositeExplicitAutograd")
FIA_V2 = getattr(torch.ops, _OP_NAMESPACE).npu_fused_infer_attention_score_v2
_HANDLED_OPS = frozenset({FIA_V2.default})


# ---------------------------------------------------------------------------------------------
# npu_scatter_nd_update_ (§2.1)
# ---------------------------------------------------------------------------------------------

_SCATTER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.int64)


def npu_scatter_nd_update_(input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """In place: ``input[tuple(indices[k])] = updates[k]`` for every leading index ``k``; returns ``input``."""
    if not 1 <= input.dim() <= 8:
        _fail(f"npu_scatter_nd_update_: input must have 1..8 dims, got shape {tuple(input.shape)}")
    if input.dtype not in _SCATTER_DTYPES:
        _fail(f"npu_scatter_nd_update_: input dtype {input.dtype} unsupported (one of {list(_SCATTER_DTYPES)})")
    if updates.dtype != input.dtype:
        _fail(f"npu_scatter_nd_update_: updates dtype {updates.dtype} must equal the input dtype {input.dtype}")
    if indices.dtype not in (torch.int32, torch.int64):
        _fail(f"npu_scatter_nd_update_: indices must be int32 or int64, got {indices.dtype}")
    if indices.dim() < 2:
        _fail(f"npu_scatter_nd_update_: indices must be at least 2-D (..., a), got shape {tuple(indices.shape)}")
    a = indices.shape[-1]
    if not 1 <= a <= input.dim():
        _fail(f"npu_scatter_nd_update_: indices' last dim {a} must be in 1..input.dim()={input.dim()}")
    want = (*indices.shape[:-1], *input.shape[a:])
    if tuple(updates.shape) != want:
        _fail(
            f"npu_scatter_nd_update_: updates shape {tuple(updates.shape)} must be indices.shape[:-1] + "
            f"input.shape[{a}:] = {want}"
        )
    if len({input.device, indices.device, updates.device}) > 1:
        _fail("npu_scatter_nd_update_: input, indices and updates must be on one device")
    index = tuple(indices[..., i].long() for i in range(a))
    input.index_put_(index, updates)
    return input


# ---------------------------------------------------------------------------------------------
# torch.npu: streams, synchronisation, NPUGraph, graph(...)
# ---------------------------------------------------------------------------------------------

_state = threading.local()  # per thread: current stream, active capture, emulated-kernel depth
_live_graphs: weakref.WeakSet[NPUGraph] = weakref.WeakSet()
_graphs_lock = threading.Lock()
_pool_ids = itertools.count(1)
_device_count = 1


class Stream:
    """An emulated stream. All work runs in order on the host, so every stream is one queue."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device
        self.priority = priority

    def synchronize(self) -> None:
        synchronize()

    def wait_stream(self, stream: Stream) -> None:
        if not isinstance(stream, Stream):
            raise TypeError(f"wait_stream expects a torch.npu.Stream, got {type(stream).__name__}")

    def __repr__(self) -> str:
        return f"<emulated torch.npu.Stream {id(self):#x}>"


_default_stream = Stream()


def current_stream(device: Any = None) -> Stream:
    stack = getattr(_state, "streams", None)
    return stack[-1] if stack else _default_stream


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """``with torch.npu.stream(s):`` makes ``s`` the current stream of this thread."""
    if s is None:
        yield
        return
    if not isinstance(s, Stream):
        raise TypeError(f"torch.npu.stream expects a torch.npu.Stream, got {type(s).__name__}")
    stack = getattr(_state, "streams", None)
    if stack is None:
        stack = _state.streams = []
    stack.append(s)
    try:
        yield
    finally:
        stack.pop()


def synchronize(device: Any = None) -> None:
    """Wait for all queued device work: every completed replay is now really finished."""
    if getattr(_state, "capture", None) is not None:
        raise CaptureSyncError(f"{SYNC_IN_CAPTURE}: torch.npu.synchronize() inside a graph capture")
    with _graphs_lock:
        for g in list(_live_graphs):
            g._unsynced_replays = 0


def is_available() -> bool:
    return True


def device_count() -> int:
    return _device_count


def current_device() -> int:
    return 0


def graph_pool_handle() -> tuple[int, int]:
    """An opaque memory-pool token (graphs given the same token may share memory)."""
    return (0, next(_pool_ids))


@contextlib.contextmanager
def _in_kernel() -> Iterator[None]:
    """Inside an emulated device kernel, reading device data is what the device does: allowed."""
    _state.kernel_depth = getattr(_state, "kernel_depth", 0) + 1
    try:
        yield
    finally:
        _state.kernel_depth -= 1


def _in_emulated_kernel() -> bool:
    return getattr(_state, "kernel_depth", 0) > 0


def _is_host_sync(func: Any, args: Sequence[Any]) -> bool:
    """Ops whose result (value or shape) the host must read from device memory."""
    if func is torch.ops.aten._local_scalar_dense.default or torch.Tag.data_dependent_output in func.tags:
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is torch.ops.aten.index.Tensor:  # integer indexing has a static shape; boolean masks do not
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return True


_HOST_READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.cpu})


class _HostReadGuard(TorchFunctionMode):
    """Catches host reads of device data that never reach the dispatcher (``tolist``, ``numpy``)."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        if func in _HOST_READS and not _in_emulated_kernel():
            raise CaptureSyncError(f"{SYNC_IN_CAPTURE}: Tensor.{func.__name__}() reads device data during capture")
        return func(*args, **(kwargs or {}))


def _tensors_of(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for x in tree for t in _tensors_of(x)]
    return []


def _copy_results(dst: Any, src: Any) -> None:
    for d, s in zip(_tensors_of(dst), _tensors_of(src), strict=True):
        d.copy_(s)


@attrs.define(eq=False)
class _OpRecord:
    """One op run during capture. ``kind``: view (skipped), mutating (re-run), functional (re-run, copied)."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: Any
    kind: str
    # Handled ops only: the emulated ExternalEvent, set by update() and consumed by replay(), and
    # the error of a failed update, which makes the waiting replay abort instead of hanging.
    released: threading.Event | None = None
    update_error: BaseException | None = None

    def run(self) -> None:
        if self.kind == "view":
            return
        result = self.func(*self.args, **self.kwargs)
        if self.kind != "mutating":
            _copy_results(self.outputs, result)


def _snapshot(value: Any) -> Any:
    """Host arguments are copied at capture (later edits of the caller's list must not leak in)."""
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    return value


class _CaptureRecorder(TorchDispatchMode):
    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_host_sync(func, args):
            raise CaptureSyncError(f"{SYNC_IN_CAPTURE}: {func} reads device data on the host during capture")
        with _in_kernel():
            outputs = func(*args, **kwargs)
        if func.is_view:
            kind = "view"
        elif func._schema.is_mutable:
            kind = "mutating"
        else:
            kind = "functional"
            results = outputs if isinstance(outputs, (tuple, list)) else [outputs]
            if any(x is not None and not isinstance(x, torch.Tensor) for x in results):
                raise CaptureSyncError(f"{SYNC_IN_CAPTURE}: {func} returns a host value computed from device data")
        record = _OpRecord(func, tuple(args), {k: _snapshot(v) for k, v in kwargs.items()}, outputs, kind)
        if func in _HANDLED_OPS and self.graph.auto_dispatch_capture:
            record.released = threading.Event()
            self.graph._handled.append(record)
        self.graph._records.append(record)
        return outputs


class NPUGraph:
    """Emulated ``torch.npu.NPUGraph``: capture_begin/capture_end, replay, update, reset, pool."""

    def __init__(self) -> None:
        self.auto_dispatch_capture = False
        self._records: list[_OpRecord] = []
        self._handled: list[_OpRecord] = []
        self._captured = False
        self._capturing = False
        self._modes: list[Any] = []
        self._pool: Any = None
        self._unsynced_replays = 0  # replays that finished on the host but were not synchronised
        with _graphs_lock:
            _live_graphs.add(self)

    # -- capture -------------------------------------------------------------------------------
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise NpuOpError(f"capture_error_mode must be 'global', 'thread_local' or 'relaxed', got {capture_error_mode!r}")
        if self._captured or self._capturing:
            raise NpuOpError("capture_begin on an NPUGraph that is already captured; call reset() first")
        if getattr(_state, "capture", None) is not None:
            raise NpuOpError("capture_begin while another NPUGraph capture is in progress on this thread")
        self._pool = pool if pool is not None else graph_pool_handle()
        self._capturing = True
        _state.capture = self
        self._modes = [_HostReadGuard(), _CaptureRecorder(self)]
        for mode in self._modes:
            mode.__enter__()

    def capture_end(self) -> None:
        if not self._capturing:
            raise NpuOpError("capture_end without capture_begin")
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = []
        self._capturing = False
        self._captured = True
        _state.capture = None

    def pool(self) -> Any:
        return self._pool

    def reset(self) -> None:
        self._records, self._handled = [], []
        self._captured = False

    # -- replay --------------------------------------------------------------------------------
    def replay(self) -> None:
        if not self._captured:
            raise NpuOpError("replay() before a successful capture")
        with torch.inference_mode():
            for index, record in enumerate(self._records):
                if record.released is not None:
                    self._wait_for_update(index, record)
                record.run()
        with _graphs_lock:
            self._unsynced_replays += 1

    def _wait_for_update(self, index: int, record: _OpRecord) -> None:
        assert record.released is not None
        if not record.released.wait(REPLAY_WAIT_TIMEOUT_S):
            raise NpuOpError(
                f"replay waited {REPLAY_WAIT_TIMEOUT_S}s at handled op #{index} for graph.update(): a graph "
                "captured with auto_dispatch_capture=True needs an update per replay (a device would hang)"
            )
        record.released.clear()
        error = record.update_error
        if error is not None:
            for other in self._handled:  # this replay ends here: no op after it consumes an update
                assert other.released is not None
                other.released.clear()
                other.update_error = None
            raise NpuOpError(
                f"replay aborted at handled op #{index}: graph.update() failed "
                f"({type(error).__name__}: {error}); a device would hang here"
            ) from error

    # -- update --------------------------------------------------------------------------------
    def update(self, cpu_update_input: Sequence[Mapping[str, Any]]) -> None:
        """Replace recorded host arguments of the handled ops and re-issue them (validating), in order."""
        if not self.auto_dispatch_capture or not self._captured:
            raise NpuOpError(
                "The current graph configuration does not support update, "
                "Try to capture by setting auto_dispatch_capture=True during capture"
            )
        done = 0
        try:
            if not isinstance(cpu_update_input, (list, tuple)) or not all(
                isinstance(u, Mapping) for u in cpu_update_input
            ):
                raise TypeError("cpu_update_input must be a list of dicts (one per handled op, or one to broadcast)")
            updates = list(cpu_update_input)
            if len(updates) == 1:
                updates = updates * len(self._handled)
            if len(updates) != len(self._handled):
                raise NpuOpError(
                    f"Currently, there are {len(self._handled)} operators that need to be updated by capture, "
                    f"and there are only {len(cpu_update_input)} elements in the incoming cpu_update_input list"
                )
            with _graphs_lock:
                racing = bool(self._handled) and self._unsynced_replays > 0
            if racing:
                raise NpuOpError(
                    "graph.update() while a previous replay of this graph may still run on the device: "
                    "synchronize before updating, or the update rewrites parameters of running tasks"
                )
            for record, new in zip(self._handled, updates):
                previous = dict(record.kwargs)
                for name, value in new.items():
                    if name in record.kwargs:  # unknown keys are ignored, as torch_npu does
                        record.kwargs[name] = _snapshot(value)
                try:
                    with _in_kernel():
                        check_fia_v2(*record.args, **record.kwargs)  # the re-issue validates like a launch
                except BaseException:
                    record.kwargs = previous  # the task keeps its old parameters
                    raise
                assert record.released is not None
                record.update_error = None
                record.released.set()
                done += 1
        except BaseException as exc:
            for record in self._handled[done:]:
                assert record.released is not None
                record.update_error = exc
                record.released.set()
            raise

    @property
    def num_handled_ops(self) -> int:
        """How many FIA calls this graph recorded for update (the length ``update()`` expects)."""
        return len(self._handled)


class graph:  # noqa: N801 - mirrors torch.npu.graph
    """``with torch.npu.graph(g, pool=..., stream=..., auto_dispatch_capture=...)``: capture into ``g``."""

    default_capture_stream: Stream | None = None

    def __init__(
        self,
        npu_graph: NPUGraph,
        pool: Any = None,
        stream: Stream | None = None,
        auto_dispatch_capture: bool = False,
        capture_error_mode: str = "global",
    ) -> None:
        if not isinstance(npu_graph, NPUGraph):
            raise TypeError(f"torch.npu.graph expects an NPUGraph, got {type(npu_graph).__name__}")
        if stream is None:
            if graph.default_capture_stream is None:
                graph.default_capture_stream = Stream()
            stream = graph.default_capture_stream
        self.npu_graph = npu_graph
        self.pool = pool
        self.capture_stream = stream
        self.auto_dispatch_capture = auto_dispatch_capture
        self.capture_error_mode = capture_error_mode
        self._stream_ctx: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        synchronize()
        self._stream_ctx = stream(self.capture_stream)
        self._stream_ctx.__enter__()
        self.npu_graph.auto_dispatch_capture = self.auto_dispatch_capture
        try:
            self.npu_graph.capture_begin(self.pool, self.capture_error_mode)
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.npu_graph.capture_end()
            if exc[0] is not None:
                self.npu_graph.reset()  # a failed capture leaves nothing to replay
        finally:
            assert self._stream_ctx is not None
            self._stream_ctx.__exit__(None, None, None)


# ---------------------------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------------------------


def _build_modules() -> tuple[types.ModuleType, types.ModuleType]:
    npu = types.ModuleType("torch_npu.npu", "Emulated torch.npu (backends.npu.emulator).")
    for name in (
        "NPUGraph", "graph", "graph_pool_handle", "synchronize", "Stream", "current_stream", "stream",
        "is_available", "device_count", "current_device",
    ):  # fmt: skip
        setattr(npu, name, globals()[name])
    top = types.ModuleType("torch_npu", "Emulated torch_npu (backends.npu.emulator): CPU stand-in, not Ascend.")
    top.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    top.__version__ = "emulator"  # type: ignore[attr-defined]
    top.IS_HAL_EMULATOR = True  # type: ignore[attr-defined]
    top.npu = npu  # type: ignore[attr-defined]
    top.npu_fused_infer_attention_score_v2 = FIA_V2  # type: ignore[attr-defined]
    top.npu_scatter_nd_update_ = npu_scatter_nd_update_  # type: ignore[attr-defined]
    return top, npu


_TORCH_NPU, _TORCH_NPU_NPU = _build_modules()
_MISSING = object()
_saved_torch_npu_attr: Any = _MISSING
_install_lock = threading.Lock()


def is_installed() -> bool:
    return sys.modules.get("torch_npu") is _TORCH_NPU


def install(*, device_count: int = 1) -> None:
    """Install the emulator as ``torch_npu`` / ``torch.npu`` (idempotent)."""
    global _saved_torch_npu_attr, _device_count
    with _install_lock:
        if device_count < 1:
            raise ValueError(f"device_count must be >= 1, got {device_count}")
        _device_count = device_count
        if is_installed():
            return
        if "torch_npu" in sys.modules:
            raise RuntimeError("a real torch_npu is already imported; the emulator will not shadow it")
        _saved_torch_npu_attr = getattr(torch, "npu", _MISSING)
        sys.modules["torch_npu"] = _TORCH_NPU
        sys.modules["torch_npu.npu"] = _TORCH_NPU_NPU
        setattr(torch, "npu", _TORCH_NPU_NPU)  # noqa: B010


def uninstall() -> None:
    """Remove the emulator from ``sys.modules`` and ``torch.npu`` (no-op if it is not installed)."""
    global _saved_torch_npu_attr
    with _install_lock:
        if not is_installed():
            return
        del sys.modules["torch_npu"]
        sys.modules.pop("torch_npu.npu", None)
        if _saved_torch_npu_attr is _MISSING:
            if hasattr(torch, "npu"):
                delattr(torch, "npu")
        else:
            setattr(torch, "npu", _saved_torch_npu_attr)  # noqa: B010
        _saved_torch_npu_attr = _MISSING


@contextlib.contextmanager
def emulated(*, device_count: int = 1) -> Iterator[types.ModuleType]:
    """``with emulated() as torch_npu:`` -- installed inside, reverted after (if it installed it)."""
    was_installed = is_installed()
    install(device_count=device_count)
    try:
        yield _TORCH_NPU
    finally:
        if not was_installed:
            uninstall()
