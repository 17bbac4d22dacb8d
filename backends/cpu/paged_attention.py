"""The CPU backend's paged attention: pure torch, vectorised over the batch, fp32 math.

Held to ``hal.oracle`` like every other backend's kernel (``hal conformance``,
``tests/backends/cpu``); differentiable, for callers that train through it.

It attends what ``hal.backends.cpu.tile_plan`` laid out for the forward: each tile group's keys
gathered into a reused workspace, or read in place where the plan found them one strided view of
the cache, through torch's CPU flash attention where the cache is fp32.
"""

from __future__ import annotations

import math

import torch

from hal.backends.cpu.tile_plan import AttentionPlan, TileGroup, plan_from_tensors
from hal.sdk import SpecError

# Tiles of at least this many query rows (prompt tiles), with qk == v head dims and no sinks, go
# through torch's fused attention with a mask; on fewer rows (decode, verify, draft steps), or
# where the head dims differ (its slow path), the explicit matmuls were measured faster.
FUSED_MIN_ROWS = 32


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


def _zero_key_rows(x: torch.Tensor, rows: torch.Tensor, workspace: GatherWorkspace | None, name: str) -> torch.Tensor:
    """``x [n, K, H, D]`` with the key rows ``rows`` (flat over ``n * K``) zeroed, in a copy: ``x`` may
    be a view of the cache, which is left as it is."""
    if workspace is None:
        out = x.clone(memory_format=torch.contiguous_format)
    else:
        out = workspace.take(name, tuple(x.shape), x.dtype, x.device).copy_(x)
    out.view(-1, x.shape[2] * x.shape[3]).index_fill_(0, rows, 0.0)
    return out


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


def _gather_rows(q: torch.Tensor, rows: torch.Tensor, workspace: GatherWorkspace | None) -> torch.Tensor:
    """``q[rows]``, into the workspace where there is one (a fresh prompt-sized tensor per layer
    costs its page faults again)."""
    if workspace is None:
        return q.index_select(0, rows)
    return torch.index_select(q, 0, rows, out=workspace.take("q", (rows.numel(), *q.shape[1:]), q.dtype, q.device))


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
    plan: AttentionPlan | None = None,
    tree_mask: torch.Tensor | None = None,  # [B, N, N] bool: TARGET_VERIFY over draft trees
) -> torch.Tensor:
    """Attention of packed queries over paged KV; rows that see no key (and no sink) are 0.

    Query row ``i`` of request ``b`` sits at absolute position ``kv_lens[b] - q_len_b + i`` and
    sees keys ``j <= p`` (and ``j >= p - sliding_window`` when a window is set); in a verify block
    over a draft tree (``tree_mask``, ``hal.tree``) the prefix and the rows its tree names. ``plan``
    is the layout ``plan_attention`` made for these lengths, block table and tree (built here from
    the tensors when not given); ``workspace`` holds the gathered K/V between calls (without it, each
    call allocates its own).
    """
    t, hq, _ = q.shape
    dv = v_cache.shape[3]
    if plan is None:
        plan = plan_from_tensors(kv_lens, cu_q_lens, block_table, k_cache, v_cache, sliding_window, chunk_bytes, tree_mask)
    if t == 0 or not plan.groups:
        return torch.zeros((t, hq, dv), dtype=q.dtype, device=q.device)
    if len(plan.groups) == 1 and plan.groups[0].out_rows is None:  # decode, verify, draft: no scatter
        return _attend_group(q, k_cache, v_cache, plan.groups[0], scaling, sinks, workspace).to(q.dtype)
    out = torch.zeros((t + 1, hq, dv), dtype=q.dtype, device=q.device)  # row t takes padding rows
    for group in plan.groups:
        result = _attend_group(q, k_cache, v_cache, group, scaling, sinks, workspace).to(q.dtype)
        if group.out_rows is None:
            assert isinstance(group.q_rows, slice)
            out[group.q_rows] = result
        else:
            out.index_copy_(0, group.out_rows, result)
    return out[:t]


def _attend_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: TileGroup,
    scaling: float,
    sinks: torch.Tensor | None,
    workspace: GatherWorkspace | None,
) -> torch.Tensor:
    """One group's output rows ``[tiles * rows, Hq, Dv]`` in fp32."""
    n, rows = group.tiles, group.rows
    hq, dk = q.shape[1], q.shape[2]
    hkv, dv = v_cache.shape[2], v_cache.shape[3]
    g = hq // hkv
    # Autograd keeps what it saves for the backward: a buffer the next layer overwrites must not be one.
    reuse = workspace if not (torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad
                                                          or (sinks is not None and sinks.requires_grad))) else None
    # [n * rows, Hq, Dk] fp32, unscaled: every path below applies ``scaling`` inside its kernel
    qt = q[group.q_rows] if isinstance(group.q_rows, slice) else _gather_rows(q, group.q_rows, reuse)
    qt = qt.float().contiguous()
    fused_tile = sinks is None and dk == dv and rows >= FUSED_MIN_ROWS
    strided = _strided_views(k_cache, v_cache, group, dk)
    if strided is not None:
        keys, values = strided
        mask, unseen = group.strided_blocked, group.strided_unseen_index
    elif group.views is not None and not group.causal_square and (group.page_ids is None or not fused_tile):
        return _rows_of(_attend_in_place(qt, k_cache, v_cache, group, scaling, sinks), group.zero_rows)
    else:
        assert group.page_ids is not None  # a group without page ids is read in place
        keys_per_tile = group.pages * v_cache.shape[1]
        keys = _gather_pages(k_cache, group.page_ids, workspace, "k").view(n, keys_per_tile, hkv, dk)
        values = _gather_pages(v_cache, group.page_ids, workspace, "v").view(n, keys_per_tile, hkv, dv)
        mask, unseen = group.blocked, group.unseen_index
        if unseen is not None:  # gathered copies: zeroed in place
            keys.view(-1, hkv * dk).index_fill_(0, unseen, 0.0), values.view(-1, hkv * dv).index_fill_(0, unseen, 0.0)
            unseen = None
    if unseen is not None:  # views of the cache: zeroed copies
        keys, values = _zero_key_rows(keys, unseen, reuse, "k-zeroed"), _zero_key_rows(values, unseen, reuse, "v-zeroed")
    if group.causal_square:
        if sinks is not None:
            raise SpecError("paged_attention: a plan made with fused=True has causal squares, which take no sinks")
        k, v = keys[:, : group.causal_square], values[:, : group.causal_square]
        if not _all_finite(k):  # a NaN/inf key must not reach the rows that do not see it
            causal = torch.ones(rows, k.shape[1], dtype=torch.bool, device=k.device).triu(1)
            return _rows_of(_explicit_attention(qt, k, v, causal[None, None, None], None, scaling), group.zero_rows)
        ctx = torch.nn.functional.scaled_dot_product_attention(
            qt.view(n, rows, hq, dk).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scaling,
            enable_gqa=g > 1,
        ).view(n, hkv, g, rows, dv)
    elif fused_tile and (mask is None or _all_finite(keys)):
        # torch's fused attention: no [rows, keys] score tensor in memory (4x faster on prompt
        # tiles). GQA as hal defines it: query head h reads kv head h // G.
        ctx = torch.nn.functional.scaled_dot_product_attention(
            qt.view(n, rows, hq, dk).transpose(1, 2), keys.transpose(1, 2), values[..., :dv].transpose(1, 2),
            attn_mask=None if mask is None else mask.view(-1, 1, rows, keys.shape[1]).logical_not(), scale=scaling,
            enable_gqa=g > 1,
        ).view(n, hkv, g, rows, dv)
    else:
        ctx = _attention(qt, keys, values, mask, sinks, dv, scaling, group.flash_masks if strided is not None else None)
    return _rows_of(ctx, group.zero_rows)


def _all_finite(keys: torch.Tensor) -> bool:
    """Whether every key is finite. The fused and flash kernels hide a key by adding -inf to its
    score (NaN + -inf is NaN), so a non-finite key some rows must not see goes to the explicit
    matmuls, which overwrite hidden scores instead (a row that sees it still gets its NaN). One sum
    over the keys carries any NaN or inf into a single value without a mask the size of the keys
    (a finite sum that overflows only sends the group to the slower, still exact, path)."""
    return bool(torch.isfinite(keys.sum()))


def _rows_of(ctx: torch.Tensor, zero_rows: torch.Tensor | None) -> torch.Tensor:
    """``[n, Hkv, G, rows, Dv]`` as packed output rows ``[n * rows, Hq, Dv]``, rows that see no key zeroed."""
    n, hkv, g, rows, dv = ctx.shape
    if zero_rows is not None:
        ctx = ctx.masked_fill(zero_rows, 0.0)
    return ctx.permute(0, 3, 1, 2, 4).reshape(n * rows, hkv * g, dv)


def _explicit_attention(
    qt: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocked: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """``[n, Hkv, G, rows, Dv]`` from the fp32 query rows ``qt [n * rows, Hq, Dk]`` of ``n``
    tiles, their ``keys [n, K, Hkv, Dk]`` and ``values [n, K, Hkv, Dv]`` (gathered, or views of the
    cache) and the mask ``blocked [n or 1, 1, 1, rows, K]`` (None: every row sees every key): a
    tile's query heads of one kv head ride as extra query rows, and the sink is one more logit in
    each row's softmax, with no value."""
    n, num_keys, hkv, dk = keys.shape
    hq, dv = qt.shape[1], values.shape[3]
    g, rows = hq // hkv, qt.shape[0] // n
    qh = qt.view(n, rows, hkv, g, dk).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * rows, dk) * scaling
    scores = _per_kv_head_matmul(qh, keys.permute(0, 2, 3, 1)).view(n, hkv, g, rows, num_keys)
    if blocked is not None:
        scores.masked_fill_(blocked, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, -1)
    else:
        sink = sinks.float().view(1, hkv, g, 1, 1).expand(n, hkv, g, rows, 1)
        weights = torch.softmax(torch.cat([sink, scores], -1), -1)[..., 1:]
    return _per_kv_head_matmul(weights.reshape(n, hkv, g * rows, num_keys), values.permute(0, 2, 1, 3)).view(n, hkv, g, rows, dv)


# torch's CPU flash attention, which also returns each row's log-sum-exp (for the sink); absent
# from a torch build without it, where the explicit matmuls serve instead.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attention(
    qt: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocked: torch.Tensor | None,
    sinks: torch.Tensor | None,
    dv: int,
    scaling: float,
    flash_masks: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[n, Hkv, G, rows, Dv]`` of fp32 ``keys``/``values`` (``values`` at least ``dv`` wide): the
    explicit matmuls, or torch's CPU flash kernel where V is as wide as K (that kernel takes equal
    qk and v head dims). V may be read wider than ``dv`` (a view running into the next head's or
    slot's values): output column ``c`` weighs V's column ``c`` alone, so the extra columns are
    dropped unread by anything else. A query head group rides as extra query rows; the sink is one
    more term of each row's softmax denominator: ``out * sigmoid(lse - sink)``. ``flash_masks``:
    where the flash kernel's form of ``blocked`` is kept across the layers of a forward."""
    if _FLASH_CPU is None or values.shape[3] != keys.shape[3] or (blocked is not None and not _all_finite(keys)):
        return _explicit_attention(qt, keys, values[..., :dv], blocked, sinks, scaling)
    n, num_keys, hkv, dk = keys.shape
    hq = qt.shape[1]
    g, rows = hq // hkv, qt.shape[0] // n
    qh = qt.view(n, rows, hkv, g, dk).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * rows, dk)
    mask = None if flash_masks is None else flash_masks.get(g)
    if blocked is not None and mask is None:  # [n or 1, 1, 1, rows, keys] -> additive, a row per query head and row
        hidden = blocked.expand(-1, 1, g, rows, -1).reshape(-1, 1, g * rows, num_keys)
        mask = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).masked_fill_(hidden, float("-inf"))
        if flash_masks is not None:
            flash_masks[g] = mask
    out, lse = _FLASH_CPU(qh, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scaling)
    ctx = out.view(n, hkv, g, rows, -1)[..., :dv]
    if sinks is not None:  # lse [n, Hkv, G * rows] less each query head's sink, broadcast over rows
        ctx = ctx * torch.sigmoid(lse.view(n, hkv, g, rows, 1) - sinks.view(1, hkv, g, 1, 1).float())
    return ctx


def _strided_views(
    k_cache: torch.Tensor, v_cache: torch.Tensor, group: TileGroup, qk_dim: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The group's tiles as fp32 views ``[n, keys, Hkv, d]`` of K and V (see ``TileGroup.strided``),
    or None when it has none or a cache's slots are not evenly spaced across its pages. V is read
    ``qk_dim`` wide where that stays inside its storage, for the flash kernel (see ``_attention``)."""
    k = _strided_view(k_cache, group)
    v = _strided_view(v_cache, group, width=max(qk_dim, v_cache.shape[3])) if _FLASH_CPU is not None else None
    v = _strided_view(v_cache, group) if v is None else v
    return None if k is None or v is None else (k.float(), v.float())


def _strided_view(cache: torch.Tensor, group: TileGroup, width: int | None = None) -> torch.Tensor | None:
    """``[n, keys, Hkv, width]`` view of ``cache`` (width: its head dim unless given) at the group's
    strided tiles, or None (no strided tiles, slots not evenly spaced across pages, or a view
    reaching past the storage)."""
    if group.strided is None:
        return None
    start, stride, keys = group.strided
    page, slot, head, dim = cache.stride()
    if page != cache.shape[1] * slot or dim != 1:
        return None
    width = cache.shape[3] if width is None else width
    offset = cache.storage_offset() + start * slot
    last = offset + ((group.tiles - 1) * stride + keys - 1) * slot + (cache.shape[2] - 1) * head + width
    if last > cache.untyped_storage().nbytes() // cache.element_size():
        return None
    return cache.as_strided((group.tiles, keys, cache.shape[2], width), (stride * slot, slot, head, 1), offset)


def _attend_in_place(
    qt: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: TileGroup, scaling: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """``_explicit_attention`` for a group whose tiles read consecutive pages, one tile at a time:
    each tile's K/V is a view of the cache (no gather), only the keys some row of it sees."""
    assert group.views is not None
    rows = group.rows
    ps, hkv = v_cache.shape[1], v_cache.shape[2]
    tiles = []
    for i, (first_page, pages, first, end) in enumerate(group.views):
        k = k_cache[first_page : first_page + pages].reshape(pages * ps, hkv, -1)[first:end].float()
        v = v_cache[first_page : first_page + pages].reshape(pages * ps, hkv, -1)[first:end].float()
        if group.blocked is None:  # a strided group: its mask spans the window every tile reads
            assert group.strided is not None
            start, stride, _ = group.strided
            at = first_page * ps + first - (start + i * stride)  # this tile's first key in the window
            shared, shared_unseen = group.strided_blocked, group.strided_unseen
            mask = None if shared is None else shared[min(i, shared.shape[0] - 1)][None, ..., at : at + end - first]
            unseen = None if shared_unseen is None else shared_unseen[min(i, shared_unseen.shape[0] - 1)][at : at + end - first]
        else:
            mask = group.blocked[i : i + 1, :, :, :, first:end]
            unseen = None if group.unseen is None else group.unseen[i, first:end]
        if unseen is not None:
            k, v = k.masked_fill(unseen, 0.0), v.masked_fill(unseen, 0.0)
        tiles.append(_attention(qt[i * rows : (i + 1) * rows], k[None], v[None], mask, sinks, v.shape[2], scaling))
    return torch.cat(tiles)


# Below this many gathered elements a batched matmul over kv heads (which first copies K or V into
# head-major order) beats one matmul per head: the copy is cheaper than the extra calls.
BATCHED_HEADS_MAX_ELEMENTS = 1 << 16


def _per_kv_head_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x [n, Hkv, M, K] @ y [n, Hkv, K, N] -> [n, Hkv, M, N]``.

    ``y`` is a strided view of the token-major gathered cache; a matmul per head reads it in
    place, where a batched matmul over heads would first copy all of K/V into head-major order.
    """
    if x.shape[1] == 1:
        return torch.matmul(x[:, 0], y[:, 0]).unsqueeze(1)
    if y.numel() <= BATCHED_HEADS_MAX_ELEMENTS:
        return torch.matmul(x, y)
    return torch.stack([torch.matmul(x[:, h], y[:, h]) for h in range(x.shape[1])], 1)
