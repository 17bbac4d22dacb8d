"""The Triton paged-attention kernel: one kernel for every forward mode.

Imported lazily (only when a ``CudaAttention`` runs), so ``import hal`` and ``import hal.backends.cuda``
never import triton, and emulation can set ``TRITON_INTERPRET=1`` before ``@triton.jit`` runs.

Work split: a program owns up to ``BLOCK_Q`` query rows of one request and every q head of one
KV head group (with split-KV, one slice of its keys: see ``split_count``) (rows ``m`` of the tile are ``(query row m // GROUP_PAD, head m % GROUP_PAD)``), so
GQA groups share each K/V tile load. Programs are numbered as in a packed layout where request
``b``'s blocks start at ``cu_q_lens[b] // BLOCK_Q + b``; a binary search over ``cu_q_lens`` finds a
program's request. The grid is ``(num_tokens // BLOCK_Q + batch, kv_heads)``: only static shapes,
so a captured graph stays valid when the runner refreshes ``kv_lens`` / ``cu_q_lens`` /
``block_table`` in place. Every length is read from those device tensors.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl

from hal.sdk import UnsupportedConfigError
from hal.sdk import tree_depths as depths_of

_INTERPRETER_LOCK = threading.Lock()

MAX_HEAD_DIM = 256  # padded q/k and v head dims above this would spill registers on the GPU


@triton.jit
def _find_request(cu_q_lens_ptr, program, num_requests, BLOCK_Q: tl.constexpr):
    """The last request ``b`` whose first block index ``cu_q_lens[b] // BLOCK_Q + b`` is <= ``program``."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_lens_ptr + mid) // BLOCK_Q + mid
        if start <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Arguments that differ from batch to batch are not specialised on (Triton would compile a variant
# for a value of 1 and one for multiples of 16): each variant costs seconds of compilation.
@triton.jit(do_not_specialize=["num_requests", "window", "split_chunk", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_lens_ptr,
    cu_q_lens_ptr,
    sinks_ptr,
    tree_ptr,  # [B, N, N] uint8 tree masks of a verify batch over draft trees (HAS_TREE)
    depth_ptr,  # [T] int32: each row's depth in its tree (HAS_TREE)
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, DV_PAD] fp32: each split's unnormalised output (NUM_SPLITS > 1)
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] fp32: each split's running max (base 2) and sum
    num_requests,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    window,
    split_chunk,  # keys per split (a multiple of BLOCK_N)
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_page,
    stride_k_slot,
    stride_k_head,
    stride_v_page,
    stride_v_slot,
    stride_v_head,
    stride_bt,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DK: tl.constexpr,
    DK_PAD: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_TREE: tl.constexpr,  # rows see the prefix and the block rows their tree names; positions by depth
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (fp32 inputs, and the CPU interpreter)
    NUM_SPLITS: tl.constexpr,  # > 1: split-KV, each program covers keys [split * split_chunk, ...)
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    LOG2E: tl.constexpr = 1.4426950408889634
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(cu_q_lens_ptr, program, num_requests, BLOCK_Q)
    q_begin = tl.load(cu_q_lens_ptr + req)
    q_len = tl.load(cu_q_lens_ptr + req + 1) - q_begin
    q_start = (program - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if q_start >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + req)
    first_pos = kv_len - q_len  # absolute position of the request's first new token

    offs_m = tl.arange(0, BLOCK_M)
    q_row = q_start + offs_m // GROUP_PAD
    head_in_group = offs_m % GROUP_PAD
    row_ok = (q_row < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    token = (q_begin + q_row).to(tl.int64)
    if HAS_TREE:
        pos = first_pos + tl.load(depth_ptr + token, mask=row_ok, other=0)
    else:
        pos = first_pos + q_row

    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q_ptrs = q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_dk[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    if HAS_SINKS and NUM_SPLITS == 1:
        # The sink is one more logit in the denominator, unscaled: start the running max there
        # (with splits, the combine kernel adds it once).
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)

    # Keys this block can see: up to its last row's position, from its first row's window start.
    kv_end = tl.minimum(first_pos + tl.minimum(q_start + BLOCK_Q, q_len), kv_len)
    kv_begin = 0
    if HAS_WINDOW:
        if HAS_TREE:  # a row's position is at least the block's first (its depth may be below its row)
            kv_begin = tl.maximum(first_pos - window, 0)
        else:
            kv_begin = tl.maximum(first_pos + q_start - window, 0)
    if NUM_SPLITS > 1:
        kv_begin = tl.maximum(kv_begin, split * split_chunk)
        kv_end = tl.minimum(kv_end, (split + 1) * split_chunk)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for n_start in range(kv_begin, kv_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        k_ptrs = (
            k_cache_ptr
            + page[None, :] * stride_k_page
            + slot[None, :] * stride_k_slot
            + kv_head * stride_k_head
            + offs_dk[:, None]
        )
        k = tl.load(k_ptrs, mask=n_ok[None, :] & (offs_dk[:, None] < DK), other=0.0)  # [DK_PAD, BLOCK_N]
        if DOT_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale_log2
        if HAS_TREE:
            block_row = offs_n - first_pos  # the key's row in the verify block (< 0: the prefix)
            in_block = (block_row >= 0) & n_ok
            tree_row = tree_ptr + (req.to(tl.int64) * q_len + q_row[:, None]) * q_len + block_row[None, :]
            sees = tl.load(tree_row, mask=row_ok[:, None] & in_block[None, :], other=0)
            visible = ((block_row[None, :] < 0) | (sees != 0)) & n_ok[None, :]
            if HAS_WINDOW:
                key_depth = tl.load(depth_ptr + q_begin + block_row, mask=in_block, other=0)
                key_pos = tl.where(in_block, first_pos + key_depth, offs_n)
                visible = visible & (key_pos[None, :] >= pos[:, None] - window)
        else:
            visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
            if HAS_WINDOW:
                visible = visible & (offs_n[None, :] >= pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_ptrs = (
            v_cache_ptr
            + page[:, None] * stride_v_page
            + slot[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + offs_dv[None, :]
        )
        v = tl.load(v_ptrs, mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)  # [BLOCK_N, DV_PAD]
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS > 1:  # partial results; _combine_splits_kernel merges them (an empty split stores -inf, 0)
        part = (token[:, None] * (tl.num_programs(1) * GROUP) + head[:, None]) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part * DV_PAD + offs_dv[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i[:, None], mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2 + 1, l_i[:, None], mask=row_ok[:, None])
        return
    # Only a row that saw no key is 0; a NaN sum (a NaN key it sees) must stay NaN, not become 0.
    empty = l_i == 0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    o_ptrs = out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    sinks_ptr,
    num_heads,
    stride_o_tok,
    stride_o_head,
    NUM_SPLITS: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One (token, head) row: merge the splits' partial softmax results (and the sink) into the output."""
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0)
    token = row // num_heads
    head = row % num_heads
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_dv = tl.arange(0, DV_PAD)
    m = tl.load(part_ml_ptr + (row * NUM_SPLITS + offs_s) * 2)
    l = tl.load(part_ml_ptr + (row * NUM_SPLITS + offs_s) * 2 + 1)
    acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * DV_PAD + offs_dv[None, :])
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_safe)  # 0 for empty splits (m = -inf)
    total = tl.sum(l * weight, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_safe)
    merged = tl.sum(acc * weight[:, None], 0)
    empty = total == 0  # as in the main kernel: a NaN total stays NaN
    out = tl.where(empty, 0.0, merged / tl.where(empty, 1.0, total))
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + offs_dv, out.to(out_ptr.dtype.element_ty),
             mask=offs_dv < DV)


def head_dims_reason(head_dim: int, v_head_dim: int) -> str | None:
    """Why the kernel's tiles do not cover these head dims, or None when they do."""
    if max(head_dim, v_head_dim) > MAX_HEAD_DIM:
        return f"Triton paged attention supports head dims up to {MAX_HEAD_DIM}, got head_dim={head_dim}, v_head_dim={v_head_dim}"
    return None


def check_head_dims(head_dim: int, v_head_dim: int) -> None:
    """Raise ``UnsupportedConfigError`` for head dims the kernel's tiles do not cover."""
    reason = head_dims_reason(head_dim, v_head_dim)
    if reason is not None:
        raise UnsupportedConfigError(reason)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tile_sizes(query_rows_hint: int, group: int, head_dim: int, v_head_dim: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N): at least 16 rows per tile (tl.dot's minimum), at most 64 unless a GQA
    group alone is wider; K/V tiles narrower for wide heads to bound register use."""
    group_pad = _next_pow2(group)
    rows = _next_pow2(max(query_rows_hint, 1)) * group_pad
    block_m = min(max(rows, 16), max(64, group_pad))
    block_q = max(block_m // group_pad, 1)
    block_n = 32 if max(_next_pow2(head_dim), _next_pow2(v_head_dim)) > 128 else 64
    return block_q, block_n


# Split-KV dispatch: split a program's keys when the grid alone would leave most SMs idle.
MIN_SPLIT_KEYS = 256  # fewer keys per split cost more in the combine step than they save
MAX_SPLITS = 32
INTERPRETER_SM_COUNT = 132  # an H200's; the CPU interpreter applies the same rule


def split_count(programs: int, capacity: int, block_n: int, sm_count: int) -> int:
    """Splits of the KV range per program (a power of two): 1 when ``programs`` (query blocks x kv
    heads) already fill ``sm_count`` SMs, else the fewest that bring the grid to at least twice the
    SM count, capped so that every split keeps ``MIN_SPLIT_KEYS`` keys of the ``capacity`` (the
    block table's width in keys, fixed for a captured graph) and at ``MAX_SPLITS``."""
    if programs >= sm_count:
        return 1
    splits = 1
    while programs * splits < 2 * sm_count and splits < MAX_SPLITS and capacity // (splits * 2) >= max(MIN_SPLIT_KEYS, block_n):
        splits *= 2
    return splits


def paged_attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [num_pages + 1, page_size, Hkv, Dk]
    v_cache: torch.Tensor,  # [num_pages + 1, page_size, Hkv, Dv]
    block_table: torch.Tensor,  # [B, max_pages] int32
    kv_lens: torch.Tensor,  # [B] int32
    cu_q_lens: torch.Tensor,  # [B + 1] int32
    *,
    scaling: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,  # [Hq]
    query_rows_hint: int,
    num_splits: int | None = None,
    tree_mask: torch.Tensor | None = None,  # [B, N, N] bool: TARGET_VERIFY over draft trees
    tree_depths: torch.Tensor | None = None,  # [T] int32, each row's depth (derived here when not given)
) -> torch.Tensor:
    """Launch the kernel; same contract as ``hal.oracle.paged_oracle``.

    ``query_rows_hint`` (rows per request, e.g. 1 for decode) only sizes tiles; it must stay the
    same across replays of a captured graph, so pass a value fixed by the mode and shapes.
    ``num_splits`` (a power of two; default ``split_count``'s rule) > 1 runs split-KV (flash
    decoding): each program attends one slice of the keys and a second kernel merges the slices.
    The choice depends only on static shapes, so it holds for every replay of a captured graph.
    ``tree_mask``: the verify rows of each request form a draft tree (``hal.tree``); its rows' depths
    are ``tree_depths`` (a captured forward derives them once, inside the capture).
    """
    t, hq, dk = q.shape
    _, page_size, hkv, dv = v_cache.shape
    check_head_dims(dk, dv)
    out = torch.empty((t, hq, dv), dtype=q.dtype, device=q.device)
    batch = block_table.shape[0]
    if t == 0 or batch == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = hq // hkv
    block_q, block_n = tile_sizes(query_rows_hint, group, dk, dv)
    interpret = q.device.type == "cpu"
    dk_pad, dv_pad = max(_next_pow2(dk), 16), max(_next_pow2(dv), 16)
    capacity = block_table.shape[1] * page_size
    programs = (t // block_q + batch) * hkv
    if num_splits is None:
        sm_count = INTERPRETER_SM_COUNT if interpret else torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = split_count(programs, capacity, block_n, sm_count)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise UnsupportedConfigError(f"num_splits must be a power of two >= 1, got {num_splits}")
    split_chunk = -(-capacity // (num_splits * block_n)) * block_n
    if num_splits > 1:
        part_acc = torch.empty((t, hq, num_splits, dv_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((t, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    if tree_mask is not None and tree_depths is None:
        tree_depths = depths_of(tree_mask).to(torch.int32).reshape(-1)
    grid = (t // block_q + batch, hkv, num_splits)
    # The CPU interpreter patches module state while a kernel runs: one launch at a time there.
    with _INTERPRETER_LOCK if interpret else contextlib.nullcontext():
        _paged_attention_kernel[grid](
            out,
            q,
            k_cache,
            v_cache,
            block_table,
            kv_lens,
            cu_q_lens,
            sinks if sinks is not None else q,  # unused pointer when there are no sinks
            q if tree_mask is None else tree_mask.view(torch.uint8),  # unused pointers for a chain
            q if tree_depths is None else tree_depths,
            part_acc,
            part_ml,
            batch,
            float(scaling) * 1.4426950408889634,
            0 if sliding_window is None else int(sliding_window),
            split_chunk,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_table.stride(0),
            PAGE_SIZE=page_size,
            GROUP=group,
            GROUP_PAD=_next_pow2(group),
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            DK=dk,
            DK_PAD=dk_pad,
            DV=dv,
            DV_PAD=dv_pad,
            HAS_WINDOW=sliding_window is not None,
            HAS_SINKS=sinks is not None,
            HAS_TREE=tree_mask is not None,
            DOT_FP32=interpret or q.dtype == torch.float32,
            NUM_SPLITS=num_splits,
            num_warps=8 if max(dk_pad, dv_pad) > 128 else 4,
        )
        if num_splits > 1:
            _combine_splits_kernel[(t * hq,)](
                out, part_acc, part_ml, sinks if sinks is not None else q, hq, out.stride(0), out.stride(1),
                NUM_SPLITS=num_splits, DV=dv, DV_PAD=dv_pad, HAS_SINKS=sinks is not None,
            )
    return out
