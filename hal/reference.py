"""The reference paged attention: pure torch, vectorised over the batch, fp32 math.

The oracle every backend is held against (``hal conformance``) and the CPU backend's kernel.
"""

from __future__ import annotations

import math

import torch


# Requests are attended in chunks whose gathered fp32 K/V stays about this size: the gathered
# copy then stays in cache for the matmuls that read it (up to 1.4x faster than one batch-wide
# gather at decode sizes) and transient memory stays bounded however large the batch.
GATHER_CHUNK_BYTES = 12 << 20


class GatherWorkspace:
    """Reusable buffers for the gathered K/V of one kernel (not shared across threads).

    A fresh multi-megabyte tensor per call comes back from the OS as untouched pages, and the
    page faults cost more than the gather itself (measured 3x); reusing one buffer avoids them.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``shape`` view of buffer ``name``, grown (contents dropped) when too small."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, workspace: GatherWorkspace | None, name: str) -> torch.Tensor:
    """``cache[pages]`` in fp32; index_select copies a whole page per index (twice the speed of
    advanced indexing)."""
    if workspace is None or (cache.requires_grad and torch.is_grad_enabled()):
        return cache.index_select(0, pages).float()
    shape = (pages.numel(), *cache.shape[1:])
    raw = torch.index_select(cache, 0, pages, out=workspace.take(name, shape, cache.dtype, cache.device))
    if cache.dtype == torch.float32:
        return raw
    return workspace.take(name + "-fp32", shape, torch.float32, cache.device).copy_(raw)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [num_pages + 1, page_size, Hkv, Dk]
    v_cache: torch.Tensor,  # [num_pages + 1, page_size, Hkv, Dv]
    block_table: torch.Tensor,  # [B, max_pages]
    kv_lens: torch.Tensor,  # [B]
    cu_q_lens: torch.Tensor,  # [B + 1]
    *,
    scaling: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    chunk_bytes: int | None = None,  # default: GATHER_CHUNK_BYTES
    workspace: GatherWorkspace | None = None,
) -> torch.Tensor:
    """Attention of packed queries over paged KV; rows that see no key (and no sink) are 0.

    Query row ``i`` of request ``b`` sits at absolute position ``kv_lens[b] - q_len_b + i`` and
    sees keys ``j <= p`` (and ``j >= p - sliding_window`` when a window is set). Consecutive
    requests are grouped so each group's gathered fp32 K/V is at most ``chunk_bytes`` (at least
    one request per group). ``workspace`` holds the gathered K/V between calls (without it, each
    call allocates its own).
    """
    t, hq, _ = q.shape
    b = block_table.shape[0]
    ps, hkv, dk, dv = v_cache.shape[1], v_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    out = torch.zeros((t, hq, dv), dtype=q.dtype, device=q.device)
    if t == 0 or b == 0:
        return out
    budget = GATHER_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    token_bytes = hkv * (dk + dv) * 4
    padded_kv = [-(-n // ps) * ps for n in kv_lens.tolist()]
    cu_host = cu_q_lens.tolist()
    start = 0
    while start < b:
        end, widest = start + 1, padded_kv[start]
        while end < b and max(widest, padded_kv[end]) * (end + 1 - start) * token_bytes <= budget:
            widest = max(widest, padded_kv[end])
            end += 1
        rows = slice(cu_host[start], cu_host[end])
        out[rows] = _attend_requests(
            q[rows], k_cache, v_cache, block_table[start:end], kv_lens[start:end],
            cu_q_lens[start : end + 1] - cu_host[start], [cu_host[i + 1] - cu_host[i] for i in range(start, end)],
            widest, scaling=scaling, sliding_window=sliding_window, sinks=sinks, workspace=workspace,
        )
        start = end
    return out


def _attend_requests(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    q_lens_host: list[int],
    padded_kv: int,
    *,
    scaling: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    workspace: GatherWorkspace | None,
) -> torch.Tensor:
    """``paged_attention`` for one group of requests, their first ``padded_kv`` slots gathered."""
    t, hq, _ = q.shape
    b = block_table.shape[0]
    ps, hkv, dv = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
    max_q = max(q_lens_host)
    if t == 0 or padded_kv == 0:
        return torch.zeros((t, hq, dv), dtype=q.dtype, device=q.device)
    cu = cu_q_lens.long()
    q_lens = cu[1:] - cu[:-1]
    kv = kv_lens.long()
    n_pages = padded_kv // ps
    pages = block_table[:, :n_pages].reshape(-1).long()
    keys = _gather_pages(k_cache, pages, workspace, "k").view(b, padded_kv, hkv, -1)
    values = _gather_pages(v_cache, pages, workspace, "v").view(b, padded_kv, hkv, dv)

    group = hq // hkv
    # Equal query lengths (decode, verify, draft steps) pack as [B, max_q] already.
    uniform = all(n == max_q for n in q_lens_host)
    if uniform:
        qp = q.float().view(b, max_q, hq, -1)
    else:
        token = torch.arange(t, device=q.device)
        req = torch.bucketize(token, cu[1:], right=True)
        row = token - cu[req]
        qp = torch.zeros((b, max_q, hq, q.shape[2]), dtype=torch.float32, device=q.device)
        qp[req, row] = q.float()
    qp = qp.view(b, max_q, hkv, group, -1)
    scores = _per_kv_head_matmul(qp.permute(0, 2, 3, 1, 4), keys.permute(0, 2, 3, 1)) * scaling  # [B, Hkv, G, max_q, K]

    pos = (kv - q_lens)[:, None] + torch.arange(max_q, device=q.device)[None, :]  # [B, max_q]
    key_idx = torch.arange(padded_kv, device=q.device)
    allowed = (key_idx[None, None, :] < kv[:, None, None]) & (key_idx[None, None, :] <= pos[..., None])
    if sliding_window is not None:
        allowed &= key_idx[None, None, :] >= pos[..., None] - sliding_window
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))

    row_max = scores.amax(-1)  # [B, Hkv, G, max_q]
    if sinks is not None:
        sink = sinks.float().view(1, hkv, group, 1).expand_as(row_max)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max[..., None])
    denom = weights.sum(-1)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    ctx = _per_kv_head_matmul(weights, values.permute(0, 2, 1, 3))  # [B, Hkv, G, max_q, Dv]
    # Rows that see no key (and no sink) are 0; a NaN anywhere in a row's inputs stays NaN.
    ctx = torch.where(denom[..., None] == 0, torch.zeros_like(ctx), ctx / denom.clamp_min(1e-30)[..., None])
    ctx = ctx.reshape(b, hq, max_q, dv).permute(0, 2, 1, 3)  # [B, max_q, Hq, Dv]
    return (ctx.reshape(t, hq, dv) if uniform else ctx[req, row]).to(q.dtype)


def _per_kv_head_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x [B, Hkv, G, Q, M] @ y [B, Hkv, M, N] -> [B, Hkv, G, Q, N]``, one matmul per kv head.

    ``y`` is a strided view of the token-major gathered cache; a matmul per head reads it in
    place, where ``einsum`` would first copy all of K/V into head-major order (4x slower).
    """
    b, hkv, g, q_rows, m = x.shape
    return torch.stack(
        [torch.matmul(x[:, h].reshape(b, g * q_rows, m), y[:, h]).view(b, g, q_rows, -1) for h in range(hkv)], 1
    )
