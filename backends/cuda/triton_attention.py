"""The Triton paged-attention kernel: one kernel for every forward mode.

Imported lazily (only when a ``CudaAttention`` runs), so ``import hal`` and ``import hal.backends.cuda``
never import triton, and emulation can set ``TRITON_INTERPRET=1`` before ``@triton.jit`` runs.

Work split: a program owns up to ``BLOCK_Q`` query rows of one request and every q head of one
KV head group (rows ``m`` of the tile are ``(query row m // GROUP_PAD, head m % GROUP_PAD)``), so
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

from hal.errors import UnsupportedConfigError

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


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_lens_ptr,
    cu_q_lens_ptr,
    sinks_ptr,
    num_requests,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    window,
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
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (fp32 inputs, and the CPU interpreter)
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    LOG2E: tl.constexpr = 1.4426950408889634
    program = tl.program_id(0)
    kv_head = tl.program_id(1)

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
    pos = first_pos + q_row
    token = (q_begin + q_row).to(tl.int64)

    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q_ptrs = q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_dk[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    if HAS_SINKS:
        # The sink is one more logit in the denominator, unscaled: start the running max there.
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
        kv_begin = tl.maximum(first_pos + q_start - window, 0)
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

    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    o_ptrs = out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))


def check_head_dims(head_dim: int, v_head_dim: int) -> None:
    """Raise ``UnsupportedConfigError`` for head dims the kernel's tiles do not cover."""
    if max(head_dim, v_head_dim) > MAX_HEAD_DIM:
        raise UnsupportedConfigError(
            f"Triton paged attention supports head dims up to {MAX_HEAD_DIM}, "
            f"got head_dim={head_dim}, v_head_dim={v_head_dim}"
        )


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
) -> torch.Tensor:
    """Launch the kernel; same contract as ``hal.reference.paged_attention``.

    ``query_rows_hint`` (rows per request, e.g. 1 for decode) only sizes tiles; it must stay the
    same across replays of a captured graph, so pass a value fixed by the mode and shapes.
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
    grid = (t // block_q + batch, hkv)
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
            batch,
            float(scaling) * 1.4426950408889634,
            0 if sliding_window is None else int(sliding_window),
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
            DOT_FP32=interpret or q.dtype == torch.float32,
            num_warps=8 if max(dk_pad, dv_pad) > 128 else 4,
        )
    return out
