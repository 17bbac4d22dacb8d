"""How the CPU backend's paged attention lays out one batch: the tile plan, built once per forward
from host-side lengths (no device read) and shared by every layer of the same kind.

Query rows are cut into tiles (a whole request in decode, verify and draft steps;
``EXTEND_TILE_ROWS`` rows of a prompt); each tile reads only the pages holding the keys it can see
(on a sliding-window layer the last ``W + rows`` positions, so the cost does not grow with the
context), and tiles are grouped by one padded shape. A step whose requests' pages lie evenly spaced
in the pool (an engine reserving each request's pages at once) is planned as one strided view of
the cache. ``hal.backends.cpu.paged_attention`` attends what this plans.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from hal.sdk import tree_depths


# Tiles of one group are attended together; a group's gathered fp32 K/V stays about this size, so
# the gathered copy stays in cache for the matmuls that read it (up to 1.4x faster than one
# batch-wide gather at decode sizes) and transient memory stays bounded however large the batch.
GATHER_CHUNK_BYTES = 12 << 20
# Query rows per tile when a request's new rows are many (prefill): with a window W a tile reads
# W + EXTEND_TILE_ROWS keys, and on full layers later tiles read more keys than earlier ones.
EXTEND_TILE_ROWS = 128
# A tile whose pages are consecutive in the pool is read in place (a view) instead of gathered.
# Tiles that are not one strided view are attended one at a time, which pays only where each
# holds at least this many K+V bytes (or is the group's only tile): below that, one batched
# gather and batched matmuls cost less than a Python loop over tiles.
VIEW_MIN_TILE_BYTES = 512 << 10
# A batch read as one strided view of the cache (see ``_strided_groups``) is attended in groups of
# up to this many fp32 K+V bytes. Nothing is copied from an fp32 cache, so the bound is on transient
# memory only (the fp32 copy of a bf16/fp16 cache, the scores), far above a gather chunk: one batch
# of matmuls over every request is what makes the in-place read fast.
STRIDED_GROUP_BYTES = 64 << 20


@attrs.frozen(eq=False)
class TileGroup:
    """Tiles attended together: ``tiles`` tiles of ``rows`` query rows over ``pages`` pages each."""

    tiles: int
    rows: int
    pages: int
    # [tiles * pages] pages to gather, in key order per tile, and [tiles, 1, 1, rows, pages *
    # page_size] bool: key hidden from the row (unused by a causal square). None for a group made
    # to be read as one strided view (``_strided_groups``), which gathers nothing.
    page_ids: torch.Tensor | None
    blocked: torch.Tensor | None
    # Packed q rows read by the tile rows: a slice when the group is a contiguous run of whole
    # tiles, else an index (padding rows read row 0).
    q_rows: slice | torch.Tensor
    # Where the tile rows' outputs go: None when q_rows is a slice (same rows), else an index
    # into the output with one extra row that padding rows write to.
    out_rows: torch.Tensor | None
    zero_rows: torch.Tensor | None  # [tiles, 1, 1, rows, 1] bool: rows that see no key (output 0), or None
    # A whole prompt with no cached prefix on a full layer: its one tile is the causal square of
    # this many rows and keys, attended with a causal kernel that skips the hidden half (0: not one).
    causal_square: int = 0
    # Per tile (first page, pages, first key, end key) when every tile's pages are consecutive in
    # the pool and worth reading in place (see VIEW_MIN_TILE_BYTES); keys count from the first
    # page's first slot, and only [first key, end key) is read. None: gather the pages.
    views: tuple[tuple[int, int, int, int], ...] | None = None
    # When the read tiles are equally wide and start equally far apart in the pool: (first slot,
    # slots between tile starts, keys per tile) and the mask over exactly those keys
    # ([tiles or 1, 1, 1, rows, keys]; None when every row sees every key, as in decode); the
    # tiles are then one strided view, attended in one batch.
    strided: tuple[int, int, int] | None = None
    strided_blocked: torch.Tensor | None = None
    # Keys no row of a tile sees ([tiles or 1, K, 1, 1] bool, over ``blocked``'s keys and over the
    # strided keys), or None when every key read is some row's: a page's tail or the rest of a shared
    # window, which may hold what an earlier owner of the page left (NaN, inf). They are read as
    # zeros, since a masked weight of 0 times NaN is NaN.
    unseen: torch.Tensor | None = None
    strided_unseen: torch.Tensor | None = None
    # The strided mask as the flash kernel takes it (additive, a row per query head and row), by
    # query heads per kv head: made by the first layer of a forward, reused by the others.
    flash_masks: dict[int, torch.Tensor] = attrs.field(factory=dict, repr=False)
    # ``unseen`` and ``strided_unseen`` as the key rows to zero, flat over ``tiles * K``: zeroing
    # by index costs a third of a broadcast masked_fill.
    unseen_index: torch.Tensor | None = attrs.field(
        default=attrs.Factory(lambda self: _key_rows(self.unseen, self.tiles), takes_self=True), repr=False)
    strided_unseen_index: torch.Tensor | None = attrs.field(
        default=attrs.Factory(lambda self: _key_rows(self.strided_unseen, self.tiles), takes_self=True), repr=False)


@attrs.frozen(eq=False)
class AttentionPlan:
    """How ``paged_attention`` lays out one batch: tile groups, built once and used by every layer."""

    groups: tuple[TileGroup, ...]


def plan_attention(
    kv_lens: Sequence[int],
    q_lens: Sequence[int],
    block_table: torch.Tensor,
    page_size: int,
    *,
    sliding_window: int | None,
    token_bytes: int,
    chunk_bytes: int | None = None,
    fused: bool = False,
    in_place: bool = False,
    tree_mask: torch.Tensor | None = None,
) -> AttentionPlan:
    """Lay out attention for requests with these host-side lengths over ``block_table``'s pages.

    ``token_bytes`` is the fp32 K+V size of one cached token (sizes the groups against
    ``chunk_bytes``, default ``GATHER_CHUNK_BYTES``). Query row ``i`` of request ``b`` sits at
    position ``kv_lens[b] - q_lens[b] + i`` and sees keys ``j <= p`` (and ``j >= p - W``).
    ``fused``: the layers attend without sinks and with equal qk and v head dims (torch's fused
    attention, no score tensor), so a prompt with no cached prefix on a full layer is one causal
    square rather than row tiles. ``in_place``: the block table may be read on the host (the
    caller's tensors live there), so tiles whose pages are consecutive are read as views of the
    cache instead of gathered (see ``VIEW_MIN_TILE_BYTES``), and a batch of equal requests on
    evenly spaced pages as one strided view (``_strided_groups``). ``tree_mask`` (host, ``[B, N,
    N]`` bool; see ``hal.tree``): the requests' new rows are verify blocks over draft trees, each
    attended as one tile whose mask follows its tree.
    """
    budget = GATHER_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    ps = page_size
    if tree_mask is not None:
        tree_mask = tree_mask.to("cpu")
    # tiles as (request, first packed row, rows, first position, first page, pages)
    tiles: list[tuple[int, int, int, int, int, int]] = []
    squares: list[TileGroup] = []
    row = 0
    for b, (kv, q) in enumerate(zip(kv_lens, q_lens)):
        if fused and sliding_window is None and q == kv > EXTEND_TILE_ROWS and tree_mask is None:
            squares.append(_causal_square(b, row, kv, block_table, ps))
            row += q
            continue
        step = max(q, 1) if tree_mask is not None else min(max(q, 1), EXTEND_TILE_ROWS)
        for first in range(0, q, step):
            n = min(step, q - first)
            pos = kv - q + first
            lo = 0 if sliding_window is None else max(0, pos - sliding_window)
            hi = min(kv, pos + n)  # one past the last key any row of the tile sees
            page_lo = lo // ps
            tiles.append((b, row + first, n, pos, page_lo, max(0, -(-hi // ps) - page_lo)))
        row += q
    if in_place and tiles and len(tiles) == len(kv_lens) and tree_mask is None:
        strided = _strided_groups(tiles, kv_lens, block_table, ps, sliding_window, token_bytes)
        if strided is not None:
            return AttentionPlan(tuple(strided))
    if len(tiles) > len(kv_lens):
        # Prompts cut into tiles: on full layers later tiles read more keys. Grouping tiles of
        # similar width pads each to fewer keys (about half the work of causal prefill).
        tiles.sort(key=lambda tile: tile[5])
    groups = []
    start = 0
    while start < len(tiles):
        end, widest, tallest = start + 1, tiles[start][5], tiles[start][2]
        while end < len(tiles) and max(widest, tiles[end][5]) * ps * (end + 1 - start) * token_bytes <= budget:
            widest, tallest = max(widest, tiles[end][5]), max(tallest, tiles[end][2])
            end += 1
        tile_trees = None if tree_mask is None else tree_mask[torch.tensor([t[0] for t in tiles[start:end]])]
        groups.append(_group(tiles[start:end], max(widest, 1), tallest, row, kv_lens, block_table, ps, sliding_window,
                             token_bytes, in_place, tile_trees))
        start = end
    return AttentionPlan(tuple(groups + squares))


def _causal_square(request: int, first_row: int, kv: int, block_table: torch.Tensor, ps: int) -> TileGroup:
    """The group of one prompt with no cached prefix: rows and keys ``0 .. kv - 1``, causal (no mask
    tensor: the kernel applies the causal rule itself)."""
    pages = -(-kv // ps)
    page_ids = block_table[request, :pages].reshape(-1).long()
    none = torch.zeros((1, 1, 1, 1, 1), dtype=torch.bool, device=block_table.device)
    return TileGroup(1, kv, pages, page_ids, none, slice(first_row, first_row + kv), None, None, causal_square=kv)


def _group(
    tiles: list[tuple[int, int, int, int, int, int]],
    pages: int,
    rows: int,
    num_tokens: int,
    kv_lens: Sequence[int],
    block_table: torch.Tensor,
    ps: int,
    sliding_window: int | None,
    token_bytes: int,
    in_place: bool,
    trees: torch.Tensor | None = None,  # [n, rows, rows]: each tile a whole verify block over a draft tree
) -> TileGroup:
    n = len(tiles)
    device = block_table.device
    # One host tensor of the tiles' numbers: request, first row, rows, first position, first page, kv.
    numbers = torch.tensor([(*t[:5], kv_lens[t[0]]) for t in tiles])
    req, n_rows, first_pos, page_lo, kv = numbers[:, 0], numbers[:, 2], numbers[:, 3], numbers[:, 4], numbers[:, 5]
    cols = (page_lo[:, None] + torch.arange(pages)[None, :]).clamp_max(block_table.shape[1] - 1)
    page_ids = block_table[req.to(device)[:, None], cols.to(device)].reshape(-1).long()

    key = (page_lo * ps)[:, None] + torch.arange(pages * ps)[None, :]  # [n, K] absolute key index
    if rows == 1:
        # One-row tiles (decode, a request's single new token): every tile's row is real and sits at
        # its request's last position, so it sees its own key: no padding row, none blind.
        real = torch.ones((n, 1), dtype=torch.bool)
        visible = (key < kv[:, None])[:, None, :]
        if sliding_window is not None:
            visible &= (key >= (first_pos - sliding_window)[:, None])[:, None, :]
        zero_rows = None
    else:
        real = torch.arange(rows)[None, :] < n_rows[:, None]  # [n, rows]
        if trees is None:
            pos = first_pos[:, None] + torch.arange(rows)[None, :]
            visible = (key[:, None, :] <= pos[:, :, None]) & (key[:, None, :] < kv[:, None, None])
            key_pos = key[:, None, :]
        else:  # the prefix, and the block rows the tree names; positions follow depth (hal.tree)
            depth = tree_depths(trees)  # [n, rows]
            pos = first_pos[:, None] + depth
            block_row = (key - first_pos[:, None]).clamp(0, rows - 1)  # [n, K]
            in_block = (key >= first_pos[:, None]) & (key < kv[:, None])
            sees = torch.gather(trees, 2, block_row[:, None, :].expand(n, rows, -1))  # [n, rows, K]
            visible = (key < first_pos[:, None])[:, None, :] | (in_block[:, None, :] & sees)
            key_pos = torch.where(key < first_pos[:, None], key, first_pos[:, None] + torch.gather(depth, 1, block_row))[:, None, :]
        if sliding_window is not None:
            visible &= key_pos >= pos[:, :, None] - sliding_window
        visible &= real[:, :, None]
        sees_none = ~visible.any(-1)  # padding rows, and rows before their request's first key
        visible[:, :, 0] |= sees_none  # they read key 0 instead of nothing (no NaN); zeroed below
        real_blind = sees_none & real
        zero_rows = real_blind.view(n, 1, 1, rows, 1).to(device) if bool(real_blind.any()) else None

    contiguous = (rows == 1 or bool(real.all())) and all(tiles[i + 1][1] == tiles[i][1] + rows for i in range(n - 1))
    if contiguous:
        q_rows: slice | torch.Tensor = slice(tiles[0][1], tiles[0][1] + n * rows)
        out_rows = None
    else:
        src = torch.tensor([t[1] for t in tiles])[:, None] + torch.arange(rows)[None, :]
        q_rows = torch.where(real, src, 0).reshape(-1).to(device)
        out_rows = torch.where(real, src, num_tokens).reshape(-1).to(device)
    blocked = (~visible).view(n, 1, 1, rows, pages * ps).to(device)
    unseen = _unseen_keys(~visible.any(1), device)
    views = None
    if in_place:
        # The keys some row of each tile sees, from its first page's first slot: [first, last + 1).
        spans = []
        for t in tiles:
            first_key = 0 if sliding_window is None else max(0, t[3] - sliding_window)
            spans.append((first_key - t[4] * ps, min(kv_lens[t[0]], t[3] + t[2]) - t[4] * ps))
        views = _in_place_views(spans, page_ids.view(n, pages), [max(t[5], 1) for t in tiles])
    strided, strided_blocked = _strided_tiles(views, ps, blocked) if views is not None and n > 1 else (None, None)
    strided_unseen = None if strided_blocked is None else _unseen_keys(strided_blocked.all(3).view(n, -1), device)
    if strided is None and n > 1 and views is not None:
        narrowest = min(end - first for _, _, first, end in views)
        if narrowest * token_bytes < VIEW_MIN_TILE_BYTES:
            views = None  # small tiles one at a time cost more than one batched gather
    # Every row sees every key (a decode step of equal requests): no mask to build per layer.
    mask = None if views is None and not bool(blocked.any()) else blocked
    return TileGroup(n, rows, pages, page_ids, mask, q_rows, out_rows, zero_rows, views=views, strided=strided,
                     strided_blocked=strided_blocked, unseen=unseen, strided_unseen=strided_unseen)


def _key_rows(unseen: torch.Tensor | None, tiles: int) -> torch.Tensor | None:
    """The flat indices over ``[tiles * K]`` of the keys ``unseen [tiles or 1, K, 1, 1]`` marks."""
    if unseen is None:
        return None
    return unseen.view(unseen.shape[0], -1).expand(tiles, -1).reshape(-1).nonzero().view(-1)


def _unseen_keys(unseen: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``unseen [tiles, K]`` (keys no row of the tile sees) as ``[tiles, K, 1, 1]`` on ``device``,
    None when there are none."""
    return unseen.view(*unseen.shape, 1, 1).to(device) if bool(unseen.any()) else None


def _strided_groups(
    tiles: list[tuple[int, int, int, int, int, int]],
    kv_lens: Sequence[int],
    block_table: torch.Tensor,
    ps: int,
    sliding_window: int | None,
    token_bytes: int,
) -> list[TileGroup] | None:
    """Groups reading a batch as one strided view of the cache, or None when it is not one: every
    request one tile of equal rows, the keys it reads on consecutive pages, and the requests'
    position-0 slots (slot of position ``p`` = offset + ``p``) evenly spaced: requests admitted
    together, their pages reserved at once. The common decode, verify and draft step. Every tile
    reads the batch's common window of positions (at most twice the keys the tiles see), with
    a mask hiding what a row does not see; one shared mask, or none, where the tiles are alike.
    Planned from the host block table's few entries."""
    rows = tiles[0][2]
    spans = []  # (request, first position read, end position, first row's position)
    for request, _, n, pos, _, _ in tiles:
        first = 0 if sliding_window is None else max(0, pos - sliding_window)
        spans.append((request, first, min(kv_lens[request], pos + n), pos))
        if n != rows:
            return None
    lo, hi = min(s[1] for s in spans), max(s[2] for s in spans)
    keys = hi - lo
    if rows < 1 or keys < 1 or len(spans) * keys > 2 * sum(end - first for _, first, end, _ in spans):
        return None
    columns = (hi - 1) // ps + 1
    if block_table.shape[0] * columns > 1024:
        # Pages consecutive means the last page read is the first plus the pages between: two
        # entries per request turn most other batches away before a large table is read whole.
        requests = torch.tensor([s[0] for s in spans])
        first_pages = block_table[requests, torch.tensor([s[1] // ps for s in spans])].tolist()
        last_pages = block_table[requests, torch.tensor([(s[2] - 1) // ps for s in spans])].tolist()
        if any(last - first != (end - 1) // ps - begin // ps
               for first, last, (_, begin, end, _) in zip(first_pages, last_pages, spans)):
            return None
    table = block_table[:, :columns].tolist()
    offsets, views = [], []
    for request, first, end, _ in spans:
        pages = table[request][first // ps : (end - 1) // ps + 1]
        if pages != list(range(pages[0], pages[0] + len(pages))):
            return None
        offsets.append((pages[0] - first // ps) * ps)
        views.append((pages[0], len(pages), first % ps, first % ps + end - first))
    stride = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    if stride < 0 or offsets[0] + lo < 0 or any(b - a != stride for a, b in zip(offsets, offsets[1:])):
        return None
    mask = unseen = None
    if rows > 1 or any(first != lo or end != hi for _, first, end, _ in spans):
        # row i of a tile sits at its position pos + i: it sees keys up to there, and on a window
        # layer from W before it; the window's other keys (other tiles' reach) are hidden too
        own = torch.tensor([pos for *_, pos in spans])[:, None] + torch.arange(rows)[None, :]  # [n, rows]
        key = lo + torch.arange(keys)
        hidden = key[None, None, :] > own[:, :, None]
        if sliding_window is not None:
            hidden |= key[None, None, :] < own[:, :, None] - sliding_window
        if bool(hidden.any()):
            alike = len({pos for *_, pos in spans}) == 1
            mask = (hidden[:1] if alike else hidden).view(1 if alike else len(spans), 1, 1, rows, keys).to(block_table.device)
            unseen = _unseen_keys((hidden[:1] if alike else hidden).all(1), block_table.device)
    per_group = max(1, STRIDED_GROUP_BYTES // max(1, keys * token_bytes))
    groups = []
    for i in range(0, len(views), per_group):
        part = views[i : i + per_group]
        part_mask = mask if mask is None or mask.shape[0] == 1 else mask[i : i + per_group]
        part_unseen = unseen if unseen is None or unseen.shape[0] == 1 else unseen[i : i + per_group]
        groups.append(TileGroup(len(part), rows, max(v[1] for v in part), None, None, slice(i * rows, (i + len(part)) * rows),
                                None, None, views=tuple(part), strided=(offsets[i] + lo, stride, keys), strided_blocked=part_mask,
                                strided_unseen=part_unseen))
    return groups


def _strided_tiles(
    views: tuple[tuple[int, int, int, int], ...], page_size: int, blocked: torch.Tensor
) -> tuple[tuple[int, int, int] | None, torch.Tensor | None]:
    """``(first slot, slots between tile starts, keys)`` and the tiles' masks over those keys, when
    every read tile is as wide as the others and their starts are evenly spaced (requests admitted
    together with equal needs), else ``(None, None)``."""
    starts = [first_page * page_size + first for first_page, _, first, _ in views]
    widths = {end - first for _, _, first, end in views}
    stride = starts[1] - starts[0]
    if len(widths) != 1 or stride < 0 or any(b - a != stride for a, b in zip(starts, starts[1:])):
        return None, None
    keys = widths.pop()
    masks = torch.stack([blocked[i, :, :, :, first : first + keys] for i, (_, _, first, _) in enumerate(views)])
    return (starts[0], stride, keys), masks


def _in_place_views(
    spans: list[tuple[int, int]], page_ids: torch.Tensor, used: list[int]
) -> tuple[tuple[int, int, int, int], ...] | None:
    """``(first page, pages, first key, end key)`` of each tile when all of them read consecutive
    pages (``used[i]`` of row ``i`` of ``page_ids``, ``[tiles, pages]`` on the host) and see at
    least one key, else None."""
    if min(end - first for first, end in spans) < 1:
        return None
    steps = page_ids[:, 1:] - page_ids[:, :-1]
    within = torch.arange(1, page_ids.shape[1])[None, :] < torch.tensor(used)[:, None]
    if not bool(torch.where(within, steps == 1, True).all()):
        return None
    return tuple((first_page, pages, first, end) for first_page, pages, (first, end) in zip(page_ids[:, 0].tolist(), used, spans))


def plan_from_tensors(
    kv_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    block_table: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    sliding_window: int | None,
    chunk_bytes: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> AttentionPlan:
    """``plan_attention`` for lengths given as tensors (read back here), for calls without metadata."""
    cu = cu_q_lens.tolist()
    token_bytes = v_cache.shape[2] * (k_cache.shape[3] + v_cache.shape[3]) * 4
    return plan_attention(
        kv_lens.tolist(), [cu[i + 1] - cu[i] for i in range(len(cu) - 1)], block_table, v_cache.shape[1],
        sliding_window=sliding_window, token_bytes=token_bytes, chunk_bytes=chunk_bytes,
        tree_mask=tree_mask,
    )
