"""The attention oracle: hal's definition of paged attention, as plain dense math.

Every backend's kernel, the CPU one included, is held to it (``hal conformance`` and the backends'
tests). It follows the conventions of ``hal.spec`` and nothing else, with no tuning:

- request ``b`` has ``kv_lens[b]`` keys, the last ``q_len`` of them written in this forward; its
  query row ``i`` sits at position ``p = kv_len - q_len + i`` (bottom-right causal, every mode);
- row ``p`` sees key ``j`` when ``j <= p``, and ``j >= p - W`` on a layer with sliding window ``W``
  (``W + 1`` keys);
- a verify block over a draft tree (``hal.tree``): row ``i`` sees the prefix and the block rows its
  tree mask names; its position is ``prefix + depth(i)``, a block key's the same, and the window
  compares positions;
- q head ``h`` reads kv head ``h // (Hq / Hkv)`` (GQA); K and V head dims may differ;
- a sink adds ``exp(sinks[h])`` to head ``h``'s softmax denominator (a logit no value carries);
- a row that sees no key is 0, sink or not.

The math runs in float64 unless asked otherwise. Only a request's own ``kv_len`` keys are read from
the pages, so nothing another request left in a page (a tail, a reused page) can reach an output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hal.attention import AttentionKernelBase
from hal.errors import SpecError
from hal.plan import ForwardPlan
from hal.spec import LayerSpec


def dense_attention(
    q: torch.Tensor,  # [T, Hq, Dk], requests packed one after another
    keys: Sequence[torch.Tensor],  # per request [kv_len, Hkv, Dk]
    values: Sequence[torch.Tensor],  # per request [kv_len, Hkv, Dv]
    q_lens: Sequence[int],
    *,
    scaling: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    compute_dtype: torch.dtype = torch.float64,
    trees: Sequence[torch.Tensor] | None = None,  # per request [q_len, q_len] bool tree mask
) -> torch.Tensor:  # [T, Hq, Dv] in compute_dtype
    """Attention of each request's query rows over that request's keys, by the definition above
    (differentiable: ``hal.speculative.distill`` trains through it in float32)."""
    hq = q.shape[1]
    outputs = []
    row = 0
    for b, (k, v, q_len) in enumerate(zip(keys, values, q_lens, strict=True)):
        kv_len = k.shape[0]
        if kv_len == 0:  # nothing to see
            outputs.append(q.new_zeros((q_len, hq, v.shape[-1]), dtype=compute_dtype))
            row += q_len
            continue
        group = hq // k.shape[1]
        qb = q[row : row + q_len].to(compute_dtype)
        kb = k.to(compute_dtype).repeat_interleave(group, dim=1)  # [kv_len, Hq, Dk]
        vb = v.to(compute_dtype).repeat_interleave(group, dim=1)  # [kv_len, Hq, Dv]
        prefix = kv_len - q_len  # below 0: the first -prefix rows have no key of their own
        # the block's rows: which of them each row sees, and their depths (a chain: all before, i)
        sees = torch.ones((q_len, q_len), dtype=torch.bool, device=q.device).tril()
        if trees is not None:
            sees = trees[b].to(q.device)
        depth = sees.sum(-1) - 1
        position = (prefix + depth)[:, None]
        cached = max(prefix, 0)
        keyed = slice(cached - prefix, q_len)  # the block rows whose keys are in the cache
        key_position = torch.cat([torch.arange(cached, device=q.device), prefix + depth[keyed]])[None, :]
        visible = torch.cat([torch.ones((q_len, cached), dtype=torch.bool, device=q.device), sees[:, keyed]], 1)
        if sliding_window is not None:
            visible &= key_position >= position - sliding_window  # [q_len, kv_len]
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * scaling
        scores = scores.masked_fill(~visible, float("-inf"))
        peak = scores.amax(-1, keepdim=True)
        if sinks is not None:
            peak = torch.maximum(peak, sinks.to(compute_dtype).view(hq, 1, 1))
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # a row that sees nothing
        weights = torch.exp(scores - peak)  # 0 where hidden
        denom = weights.sum(-1, keepdim=True)
        if sinks is not None:
            denom = denom + torch.exp(sinks.to(compute_dtype).view(hq, 1, 1) - peak)
        out = torch.einsum("hqk,khd->qhd", weights / torch.where(denom > 0, denom, torch.ones_like(denom)), vb)
        outputs.append(torch.where(visible.any(-1)[:, None, None], out, torch.zeros_like(out)))
        row += q_len
    if row != q.shape[0]:
        raise SpecError(f"dense_attention: q has {q.shape[0]} rows, q_lens add up to {row}")
    if not outputs:
        dv = values[0].shape[-1] if values else 0
        return q.new_zeros((0, hq, dv), dtype=compute_dtype)
    return torch.cat(outputs)


def request_rows(
    cache: torch.Tensor,  # [num_pages + 1, page_size, H, D]
    block_table_row: Sequence[int],
    kv_len: int,
) -> torch.Tensor:  # [kv_len, H, D]
    """A request's first ``kv_len`` cached rows, in position order, read through its pages."""
    page_size = cache.shape[1]
    positions = torch.arange(kv_len)
    pages = torch.tensor(list(block_table_row), dtype=torch.int64)[positions // page_size]
    slots = (pages * page_size + positions % page_size).to(cache.device)
    return cache.reshape(-1, *cache.shape[2:]).index_select(0, slots)


def paged_oracle(
    q: torch.Tensor,  # [T, Hq, Dk]
    k_cache: torch.Tensor,  # [num_pages + 1, page_size, Hkv, Dk]
    v_cache: torch.Tensor,  # [num_pages + 1, page_size, Hkv, Dv]
    block_table: torch.Tensor,  # [B, max_pages]
    kv_lens: torch.Tensor,  # [B]
    cu_q_lens: torch.Tensor,  # [B + 1]
    *,
    scaling: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    tree_mask: torch.Tensor | None = None,  # [B, N, N] bool: TARGET_VERIFY over draft trees
) -> torch.Tensor:  # [T, Hq, Dv] in compute_dtype
    """``dense_attention`` over the paged cache: the signature every backend's kernel has."""
    lens = [int(n) for n in kv_lens.tolist()]
    bounds = [int(n) for n in cu_q_lens.tolist()]
    table = block_table.tolist()
    if q.shape[0] == 0:
        return q.new_zeros((0, q.shape[1], v_cache.shape[-1]), dtype=compute_dtype)
    keys = [request_rows(k_cache, table[b], n) for b, n in enumerate(lens)]
    values = [request_rows(v_cache, table[b], n) for b, n in enumerate(lens)]
    q_lens = [end - start for start, end in zip(bounds, bounds[1:])]
    trees = None if tree_mask is None else list(tree_mask.to("cpu"))
    return dense_attention(q, keys, values, q_lens, scaling=scaling, sliding_window=sliding_window, sinks=sinks,
                           compute_dtype=compute_dtype, trees=trees)


class OracleAttention(AttentionKernelBase):
    """An ``AttentionKernel`` over any pool whose attention is ``paged_oracle``: what the conformance
    kit runs beside a backend's kernel, on a pool with the same contents. Not for speed: it reads
    lengths and block tables on the host."""

    serves_trees = True

    def _attend(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        return self._paged(paged_oracle, q, layer, plan, sinks).to(q.dtype)


__all__ = ["OracleAttention", "dense_attention", "paged_oracle", "request_rows"]
