"""Attention metadata and its builder: per-request lengths -> what every kernel needs.

Conventions (shared by every backend):
- Tokens of a batch are packed request after request (TND): request ``b`` owns rows
  ``cu_q_lens[b]:cu_q_lens[b + 1]``.
- ``kv_lens[b]`` is the request's KV length *after* this forward's tokens are written,
  so ``q_lens[b] <= kv_lens[b]``; its new tokens sit at absolute positions
  ``kv_lens[b] - q_lens[b] ... kv_lens[b] - 1``.
- Every mode uses one masking rule: the query at absolute position ``p`` sees keys
  ``j <= p`` (causal inside the new rows), and on a sliding-window layer only
  ``p - W <= j`` as well (see ``hal.spec``).
- ``block_table[b, i]`` is the page holding the request's tokens ``i*page_size ...``;
  unused entries are 0, the padding page.
- A ``TARGET_VERIFY`` batch may carry a tree (``tree_mask``, see ``hal.tree``): then a verify row
  sees the prefix and the rows its mask names, and its position is ``prefix + depth``.
"""

from __future__ import annotations

import array
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import attrs
import torch

from hal.errors import KVLayoutError, SpecError
from hal.graph import is_capturing
from hal.spec import (READ_AS_LIST_LIMIT, ForwardMode, KVPoolSpec, check_integer_tensor, check_readable, host_copy, int_at_least,
                      int_bounds, strict_ints)
from hal.tree import check_tree_mask, tree_depths


def _check_request_lengths(where: str, q_lens: Sequence[int], kv_lens: Sequence[int]) -> None:
    for i, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        if q < 0 or kv < q:
            raise SpecError(f"{where} request {i}: need 0 <= q_len <= kv_len, got q_len={q}, kv_len={kv}")


@runtime_checkable
class AddressedPool(Protocol):
    """What metadata reads of a KV pool: its spec and device, its slot and page checks and its
    SWA page translation (the part of ``hal.KVPool`` that addresses pages; every pool has it)."""

    spec: KVPoolSpec
    device: torch.device

    def check_slots(self, loc: torch.Tensor, where: str, *, swa: bool | None = None) -> None:
        """Host-side: raise ``CacheLocationError`` for a slot outside the pool (or, on a hybrid pool,
        in a page with no SWA page behind it); ``where`` starts the message."""
        ...

    def check_pages(self, pages: torch.Tensor, where: str) -> None:
        """Host-side: raise ``CacheLocationError`` for a page id outside ``0..num_pages``."""
        ...

    def swa_block_table(self, block_table: torch.Tensor) -> torch.Tensor:
        """A full-pool block table translated to SWA sub-pool pages (page 0 stays 0)."""
        ...


@attrs.frozen(eq=False)
class AttentionMetadata:
    """Everything an attention kernel needs for one forward. Build it with ``build_metadata``.

    A record: device tensors are what kernels read, the ``*_cpu`` tuples and host copies the same
    values on the host (kernels whose ops take host lists, FIA on Ascend, read them; a graph
    update carries them into a captured graph). The two always describe one batch: a captured
    forward that takes a new batch into its tensors gets a new record for it
    (``hal.graph_runner.refreshed_metadata``), never the old one with rewritten tensors. Records
    ``build_metadata`` made from the same block table or query lengths may share those tensors
    (it keeps a few recent ones): read a record's tensors, never write into them.
    """

    mode: ForwardMode
    page_size: int
    kv_lens_cpu: tuple[int, ...] = attrs.field(converter=lambda v: strict_ints(v, "AttentionMetadata.kv_lens"))
    q_lens_cpu: tuple[int, ...] = attrs.field(converter=lambda v: strict_ints(v, "AttentionMetadata.q_lens"))
    kv_lens: torch.Tensor  # [B] int32
    q_lens: torch.Tensor  # [B] int32
    cu_q_lens: torch.Tensor  # [B + 1] int32, starts at 0
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, full-pool slot each new token is written to
    block_table: torch.Tensor  # [B, max_pages] int32, page ids
    swa_block_table: torch.Tensor | None = None  # same, translated to the SWA sub-pool
    # Host copies of out_cache_loc and block_table: checks against a pool read them without a
    # device sync. None when the metadata was built from device tensors directly.
    out_cache_loc_host: torch.Tensor | None = attrs.field(default=None, repr=False)
    block_table_host: torch.Tensor | None = attrs.field(default=None, repr=False)
    # TARGET_VERIFY over a draft tree: [B, q_len, q_len] bool, row i True at the verify rows it sees
    # (itself and its ancestors; see hal.tree). None: a chain, each row sees every row before it.
    tree_mask: torch.Tensor | None = None
    tree_mask_host: torch.Tensor | None = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.mode, ForwardMode):
            raise SpecError(f"AttentionMetadata.mode must be a hal.ForwardMode, got {self.mode!r}")
        b, t = len(self.kv_lens_cpu), sum(self.q_lens_cpu)
        if len(self.q_lens_cpu) != b:
            raise SpecError(
                f"AttentionMetadata.q_lens has {len(self.q_lens_cpu)} entries, kv_lens has {b}"
            )
        _check_request_lengths("AttentionMetadata", self.q_lens_cpu, self.kv_lens_cpu)
        _check_lengths_fit_mode(self.mode, self.q_lens_cpu)
        for name, tensor, shape in (("kv_lens", self.kv_lens, (b,)), ("q_lens", self.q_lens, (b,)),
                                    ("cu_q_lens", self.cu_q_lens, (b + 1,)), ("positions", self.positions, (t,)),
                                    ("out_cache_loc", self.out_cache_loc, (t,))):
            if tensor.shape != shape:
                raise SpecError(f"AttentionMetadata.{name} has shape {tuple(tensor.shape)}, expected {shape}")
        for name in ("block_table", "swa_block_table"):
            table = getattr(self, name)
            if table is None:
                continue
            if table.dim() != 2 or table.shape[0] != b:
                raise SpecError(
                    f"AttentionMetadata.{name} has shape {tuple(table.shape)}, expected ({b}, max_pages)"
                )
            capacity = table.shape[1] * self.page_size
            if self.kv_lens_cpu and max(self.kv_lens_cpu) > capacity:
                raise SpecError(
                    f"AttentionMetadata.{name} holds {table.shape[1]} pages of {self.page_size} "
                    f"tokens, too few for kv_len {max(self.kv_lens_cpu)}"
                )
        if self.tree_mask is not None:
            if self.mode is not ForwardMode.TARGET_VERIFY:
                raise SpecError(f"AttentionMetadata: a tree_mask belongs to TARGET_VERIFY batches, got {self.mode.name}")
            n = self.q_lens_cpu[0] if b else 0
            if tuple(self.tree_mask.shape) != (b, n, n) or self.tree_mask.dtype != torch.bool:
                raise SpecError(f"AttentionMetadata.tree_mask is a {self.tree_mask.dtype} tensor of shape "
                                f"{tuple(self.tree_mask.shape)}, expected bool ({b}, {n}, {n})")

    @classmethod
    def _made_consistent(cls, **fields: object) -> AttentionMetadata:
        """The record of ``fields`` that ``build_metadata`` made consistent (int tuples of equal
        length, lengths checked, tensors shaped from them, tables wide enough, the tree checked), with
        only what the mode asks of the lengths checked here: ``__attrs_post_init__``'s other checks
        hold by construction, and each costs microseconds once per forward."""
        _check_lengths_fit_mode(fields["mode"], fields["q_lens_cpu"])  # type: ignore[arg-type]
        record = object.__new__(cls)
        for name in _METADATA_FIELDS:  # every field given: a KeyError here is a builder's bug
            object.__setattr__(record, name, fields[name])
        return record

    @property
    def batch_size(self) -> int:
        """Requests this metadata describes (padding rows of a padded batch included)."""
        return len(self.kv_lens_cpu)

    @property
    def num_tokens(self) -> int:
        """Packed query tokens (rows of q, k and v)."""
        return self.positions.shape[0]  # type: ignore[no-any-return]

    @property
    def cu_q_lens_cpu(self) -> tuple[int, ...]:
        """Cumulative query ends, without the leading 0 (FIA TND ``actual_seq_qlen``)."""
        out, acc = [], 0
        for q in self.q_lens_cpu:
            acc += q
            out.append(acc)
        return tuple(out)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The device tensors by name (what a captured graph holds at fixed addresses)."""
        names = ("kv_lens", "q_lens", "cu_q_lens", "positions", "out_cache_loc", "block_table")
        out = {name: getattr(self, name) for name in names}
        if self.swa_block_table is not None:
            out["swa_block_table"] = self.swa_block_table
        if self.tree_mask is not None:
            out["tree_mask"] = self.tree_mask
        return out


_METADATA_FIELDS = tuple(field.name for field in attrs.fields(AttentionMetadata))
_HOST = torch.device("cpu")


def _check_lengths_fit_mode(mode: ForwardMode, q_lens: Sequence[int]) -> None:
    """What a forward mode asks of the query lengths: none in IDLE, one per request in DECODE, one
    length for every request where the mode has one."""
    if mode.is_idle() and any(q_lens):
        raise SpecError(f"AttentionMetadata: IDLE carries no tokens, got q_lens {tuple(q_lens)}")
    if mode.is_decode() and any(q != 1 for q in q_lens):
        raise SpecError(f"AttentionMetadata: DECODE needs q_len 1 per request, got {tuple(q_lens)}")
    if mode.has_uniform_query_len() and len(set(q_lens)) > 1:
        raise SpecError(f"AttentionMetadata: {mode.name} needs the same q_len for every request, got {tuple(q_lens)}")


# The pool ``build_metadata`` checked a record against (slots and page ids, page size, devices):
# the plan step for that pool has nothing left to check. Kept beside the record, which stays a
# plain one: a record made from it (``attrs.evolve``) is another key, checked afresh.
_CHECKED_FOR: weakref.WeakKeyDictionary[AttentionMetadata, AddressedPool] = weakref.WeakKeyDictionary()


def check_metadata_against(metadata: AttentionMetadata, pool: AddressedPool) -> None:
    """Raise a typed error, before anything is written, if ``metadata`` does not fit ``pool``: the
    page size, the devices of its tensors, slots in range (and SWA-mapped on a hybrid pool), page
    ids in ``0..num_pages``. What ``hal.ForwardPlan`` checks once per forward.

    Reads the host copies; without them (metadata built from device tensors) it reads the device
    tensors. Inside a graph capture it checks the page size and devices only: a capture reads no
    values on the host, and whoever replays checks each replay's metadata (``GraphRunner.run``, an
    engine adapter's refresh)."""
    if _CHECKED_FOR.get(metadata) is pool:
        return
    if metadata.page_size != pool.spec.page_size:
        raise SpecError(f"metadata.page_size={metadata.page_size} but the pool's page_size is {pool.spec.page_size}")
    for name, tensor in metadata.tensors().items():
        if tensor.device != pool.device:
            raise KVLayoutError(f"metadata.{name} is on {tensor.device}, the KV pool is on {pool.device}")
    if is_capturing():
        return
    loc, table = metadata.out_cache_loc_host, metadata.block_table_host
    if loc is None or table is None:
        loc, table = metadata.out_cache_loc.cpu(), metadata.block_table.cpu()
    pool.check_slots(loc, "metadata.out_cache_loc")
    pool.check_pages(table, "metadata.block_table")


def build_metadata(
    mode: ForwardMode,
    *,
    kv_lens: Sequence[int] | torch.Tensor,
    q_lens: Sequence[int] | torch.Tensor,
    page_table: Sequence[Sequence[int]] | torch.Tensor,
    out_cache_loc: Sequence[int] | torch.Tensor,
    pool: AddressedPool | None = None,
    page_size: int | None = None,
    device: torch.device | str | None = None,
    max_pages: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Build metadata from host-side per-request lengths.

    ``page_table`` lists each request's pages in order (ragged lists, or a 2-D tensor);
    it is padded with 0 to ``max_pages`` columns (default: the most any request needs).
    ``pool`` gives the page size, device and page range; with a hybrid SWA pool the SWA block
    table is derived through its mapping. Slots are checked against a pool by the plan step
    (``AttentionKernel.plan``), once per forward and kernel; built for a pool without an SWA part
    (its page size, on its device), the record is checked here instead, once. ``tree_mask`` (``TARGET_VERIFY``
    only, ``[B, q_len, q_len]`` bool, e.g. ``hal.tree.tree_mask_from_parents``) makes the verify
    rows a tree: checked by ``hal.tree.check_tree_mask``, positions ``prefix + depth``.
    """
    if pool is not None:
        page_size = pool.spec.page_size if page_size is None else page_size
        device = pool.device if device is None else device
    if page_size is None:
        raise SpecError("build_metadata needs page_size (or a pool)")
    page_size = int_at_least(page_size, 1, "build_metadata: page_size")
    if max_pages is not None:
        max_pages = int_at_least(max_pages, 1, "build_metadata: max_pages")
    device = _HOST if device is None else device if isinstance(device, torch.device) else torch.device(device)
    if not isinstance(mode, ForwardMode):
        raise SpecError(f"build_metadata: mode must be a hal.ForwardMode, got {mode!r} ({type(mode).__name__})")
    kv = strict_ints(kv_lens, "build_metadata: kv_lens")
    q = strict_ints(q_lens, "build_metadata: q_lens")
    if len(kv) != len(q):
        raise SpecError(f"build_metadata: {len(q)} q_lens but {len(kv)} kv_lens")
    _check_request_lengths("build_metadata", q, kv)  # before any tensor op trips on a bad length
    if isinstance(page_table, (str, bytes)) or not isinstance(page_table, (Sequence, torch.Tensor)):
        raise SpecError(f"build_metadata: page_table must be a sequence of page lists, got {type(page_table).__name__}")
    last_page = pool.spec.num_pages if pool is not None else None
    need = [-(-n // page_size) for n in kv]
    width = max(max(need, default=0) if max_pages is None else max_pages, 1)
    if max(need, default=0) > width:
        raise SpecError(f"build_metadata: max_pages={width} is below the {max(need)} pages a request needs")
    if isinstance(page_table, torch.Tensor) and page_table.dim() == 2:
        table = _table_from_tensor(page_table, kv, need, width, page_size, last_page)
    else:
        table = _table_from_rows(_page_rows(page_table), kv, need, width, page_size, last_page)
    slots: Sequence[int] | None = None  # out_cache_loc's values, where they are read on the host at once
    if isinstance(out_cache_loc, torch.Tensor):
        if out_cache_loc.dtype not in (torch.int32, torch.int64):
            raise SpecError(f"build_metadata: out_cache_loc must be an int32/int64 tensor, got {out_cache_loc.dtype}")
        check_readable(out_cache_loc, "build_metadata: out_cache_loc")
        flat = out_cache_loc if out_cache_loc.dim() == 1 else out_cache_loc.reshape(-1)
        if flat.numel() <= READ_AS_LIST_LIMIT:  # a step's few slots: one read, then the checks on the list
            slots = flat.tolist()
            loc = host_ints(slots, torch.int64, "build_metadata: out_cache_loc")
        else:
            loc = flat.to("cpu", torch.int64, copy=True)  # one op; a copy the caller cannot change
    else:
        slots = strict_ints(out_cache_loc, "build_metadata: out_cache_loc")
        loc = host_ints(slots, torch.int64, "build_metadata: out_cache_loc")
    b = len(kv)
    kv_t = host_ints(kv, torch.int32, "build_metadata: kv_lens")
    q_t, cu = _recent_tensors(("q_lens", q), lambda: host_int_runs([*q, 0, *itertools.accumulate(q)], (b, b + 1), torch.int32,
                                                                   "build_metadata: q_lens"))
    total = sum(q)
    tree_host = None
    if tree_mask is not None:
        if mode is not ForwardMode.TARGET_VERIFY:
            raise SpecError(f"build_metadata: a tree_mask belongs to TARGET_VERIFY batches, got {mode.name}")
        if len(set(q)) > 1:
            raise SpecError(f"build_metadata: TARGET_VERIFY needs the same q_len for every request, got {q}")
        tree_host = host_copy(tree_mask, "build_metadata: tree_mask") if isinstance(tree_mask, torch.Tensor) else tree_mask
        check_tree_mask(tree_host, len(q), q[0] if q else 0, "build_metadata")
        depth = tree_depths(tree_host)
        positions = (torch.tensor([k - n for k, n in zip(kv, q)], dtype=torch.int64)[:, None] + depth).reshape(-1)
    else:
        positions = host_ints([p for k, n in zip(kv, q) for p in range(k - n, k)], torch.int64, "build_metadata: positions")
    if loc.numel() != total:
        raise SpecError(f"build_metadata: out_cache_loc has shape ({loc.numel()},), expected ({total},): one slot per new token")
    d_positions, d_loc, d_kv, d_q, d_cu, d_table = _upload([positions, loc, kv_t, q_t, cu, table], device)
    swa_table = None
    if pool is not None and pool.spec.swa is not None:
        swa_table = pool.swa_block_table(d_table)
    metadata = AttentionMetadata._made_consistent(
        mode=mode,
        page_size=page_size,
        kv_lens_cpu=kv,
        q_lens_cpu=q,
        kv_lens=d_kv,
        q_lens=d_q,
        cu_q_lens=d_cu,
        positions=d_positions,
        out_cache_loc=d_loc,
        block_table=d_table,
        swa_block_table=swa_table,
        out_cache_loc_host=loc,
        block_table_host=table,
        tree_mask=None if tree_host is None else tree_host.to(device, non_blocking=True),
        tree_mask_host=tree_host,
    )
    _check_slots_written_once(loc, page_size, slots)
    if pool is not None and pool.spec.swa is None and page_size == pool.spec.page_size and device == pool.device:
        # What the plan step would check for this pool, with the page ids checked above: done once
        # here. A hybrid pool's SWA mapping may change before the plan, which checks it then.
        pool.check_slots(loc, "metadata.out_cache_loc")
        _CHECKED_FOR[metadata] = pool
    return metadata


def _bad_page_message(row: int, bad: Sequence[int], last_page: int | None) -> str:
    # A negative page id would silently wrap when a kernel indexes the pool.
    expected = f"0..{last_page}" if last_page is not None else ">= 0"
    return f"build_metadata: page_table row {row} has page ids {list(bad)}, expected {expected}"


def _table_from_rows(
    rows: list[list[int]], kv: Sequence[int], need: Sequence[int], width: int, page_size: int, last_page: int | None
) -> torch.Tensor:
    """The int32 block table ``[B, width]`` from ragged page lists, each checked."""
    if len(rows) != len(kv):
        raise SpecError(f"build_metadata: page_table has {len(rows)} rows for {len(kv)} requests")
    lo = min((min(row) for row in rows if row), default=0)
    hi = max((max(row) for row in rows if row), default=0)
    if lo < 0 or (last_page is not None and hi > last_page):
        bad_row = next(i for i, r in enumerate(rows) if r and (min(r) < 0 or (last_page is not None and max(r) > last_page)))
        bad = [p for p in rows[bad_row] if p < 0 or (last_page is not None and p > last_page)]
        raise SpecError(_bad_page_message(bad_row, bad, last_page))
    for i, (row, n) in enumerate(zip(rows, need)):
        if len(row) < n:
            raise SpecError(f"build_metadata: request {i} has kv_len {kv[i]} but only {len(row)} pages of {page_size}")
    padded = rows if all(len(row) == width for row in rows) else [row[:width] + [0] * (width - len(row)) for row in rows]
    flat = tuple(itertools.chain.from_iterable(padded))

    def make() -> tuple[torch.Tensor]:
        return (host_ints(flat, torch.int32, "build_metadata: page_table").view(len(kv), width),)

    # kept by value only when small: a large table would hold its ids twice over
    return (make() if len(flat) > RECENT_TABLE_LIMIT else _recent_tensors(("page_table", width, flat), make))[0]


def _table_from_tensor(
    pages: torch.Tensor, kv: Sequence[int], need: Sequence[int], width: int, page_size: int, last_page: int | None
) -> torch.Tensor:
    """The int32 block table ``[B, width]`` from a 2-D integer tensor (every row holds
    ``pages.shape[1]`` entries, zeros past a request's own pages; columns past the ``width`` the
    batch needs are not its own): the few page ids of a step of a few requests read into lists at
    once and checked there (``_table_from_rows``), a larger table checked with tensor ops."""
    check_integer_tensor(pages, "build_metadata: page_table[0]")
    check_readable(pages, "build_metadata: page_table")
    if pages.shape[0] != len(kv):
        raise SpecError(f"build_metadata: page_table has {pages.shape[0]} rows for {len(kv)} requests")
    if pages.numel() <= READ_AS_LIST_LIMIT:  # read whole, cut in Python: no slice op
        rows = pages.tolist()
        return _table_from_rows(rows if pages.shape[1] == width else [row[:width] for row in rows], kv, need, width, page_size,
                                last_page)
    used = pages[:, :width] if pages.shape[1] > width else pages  # the page ids the metadata holds
    if used.numel() <= READ_AS_LIST_LIMIT:
        return _table_from_rows(used.tolist(), kv, need, width, page_size, last_page)
    used = used.cpu()  # the tensor itself when it is on the host: the table below is a copy
    lo, hi = int_bounds(used)  # the message below names the row
    if lo < 0 or (last_page is not None and hi > last_page):
        bad = (used < 0) if last_page is None else ((used < 0) | (used > last_page))
        row = int(bad.any(1).nonzero()[0])
        raise SpecError(_bad_page_message(row, used[row][bad[row]].tolist(), last_page))
    if max(need, default=0) > pages.shape[1]:
        i = next(i for i, n in enumerate(need) if n > pages.shape[1])
        raise SpecError(f"build_metadata: request {i} has kv_len {kv[i]} but only {pages.shape[1]} pages of {page_size}")
    if used.shape[1] == width:  # an engine's table is as wide as its longest request can grow
        if used.dtype == torch.int32:  # a clone costs two thirds of a converting copy
            return used.clone(memory_format=torch.contiguous_format)  # a copy: the engine's later changes stay out
        return used.to(torch.int32, memory_format=torch.contiguous_format, copy=True)
    table = torch.zeros((len(kv), width), dtype=torch.int32)
    table[:, : used.shape[1]] = used
    return table


def _page_rows(page_table: Sequence[Sequence[int]] | torch.Tensor) -> list[list[int]]:
    """Each request's page ids as a list of ints, row by row through ``strict_ints`` (a 2-D tensor
    goes to ``_table_from_tensor`` instead)."""
    return [list(strict_ints(r, f"build_metadata: page_table[{i}]")) for i, r in enumerate(page_table)]


# array typecodes of the integer dtypes host_ints makes ("i" is a C int: 4 bytes wherever torch runs)
_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}
assert all(array.array(code).itemsize == dtype.itemsize for dtype, code in _ARRAY_CODES.items())


def host_ints(values: Sequence[int], dtype: torch.dtype, what: str) -> torch.Tensor:
    """A host int32/int64 tensor of ``values``, converted in one pass (a third of ``torch.tensor``'s
    cost for a step's few lengths); a value outside the dtype's range is a ``SpecError`` naming ``what``."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(_int_array(values, dtype, what), dtype=dtype)


def host_int_runs(values: Sequence[int], runs: Sequence[int], dtype: torch.dtype, what: str) -> list[torch.Tensor]:
    """``host_ints`` of ``values`` cut into consecutive runs of the given lengths, one tensor per run
    over one buffer: made from the buffer, not sliced from a tensor (a slice is a torch op, which
    costs more in a build run between a model's layers, its caches cold)."""
    assert sum(runs) == len(values)
    if not values:
        return [torch.empty(0, dtype=dtype) for _ in runs]
    buffer, size, at, parts = _int_array(values, dtype, what), dtype.itemsize, 0, []
    for n in runs:
        parts.append(torch.frombuffer(buffer, dtype=dtype, count=n, offset=at * size) if n else torch.empty(0, dtype=dtype))
        at += n
    return parts


#: How many of the last builds' block tables and query lengths ``_recent_tensors`` keeps, and the
#: most page ids a table it keeps may hold (an engine step's few requests' pages).
RECENT_TENSORS_LIMIT = 64
RECENT_TABLE_LIMIT = 4096
_recent: dict[tuple[object, ...], tuple[torch.Tensor, ...]] = {}


def _recent_tensors(key: tuple[object, ...], make: Callable[[], Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """The host tensors a recent build made for these values (``key``: what they hold), else
    ``make()``'s, kept for the next build. An engine's decode steps repeat their block table for a
    page's worth of tokens and their query lengths for as long as the batch lasts, and a tensor costs
    far more to make than a lookup (tens of microseconds each in a step, its caches cold). Records
    built from equal values share these tensors, and no others: metadata tensors are read, never
    written in place."""
    found = _recent.get(key)
    if found is None:
        found = _recent[key] = tuple(make())
        if len(_recent) > RECENT_TENSORS_LIMIT:
            try:  # the oldest; another thread's build may have changed the dict meanwhile: evict next time
                del _recent[next(iter(_recent))]
            except (RuntimeError, KeyError):
                pass
    return found


def _int_array(values: Sequence[int], dtype: torch.dtype, what: str) -> array.array:
    try:
        return array.array(_ARRAY_CODES[dtype], values)
    except OverflowError:
        info = torch.iinfo(dtype)
        bad = next(v for v in values if not info.min <= v <= info.max)
        raise SpecError(f"{what}: {bad} does not fit {dtype} ([{info.min}, {info.max}])") from None


def _upload(host: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The int32/int64 host tensors on ``device`` with one copy: packed into one int32 buffer (pinned
    where the runtime allows, so the copy does not wait for the device), then viewed back. When
    ``device`` is the host's, they come back as they are."""
    if host[0].device == device:  # all on the host: one of them says where that is
        return host
    return unpack_ints(pack_ints(host, pin_memory=True).to(device, non_blocking=True), host)


def pack_ints(tensors: Sequence[torch.Tensor], *, pin_memory: bool = False) -> torch.Tensor:
    """int32/int64 host tensors in one int32 buffer (int64 ones first, at 8-byte aligned offsets)."""
    layout = _pack_layout(tensors)
    size = sum(words for _, _, words in layout)
    try:
        packed = torch.empty(size, dtype=torch.int32, pin_memory=pin_memory)
    except RuntimeError:  # no pinned memory for this runtime
        packed = torch.empty(size, dtype=torch.int32)
    for i, offset, words in layout:
        packed[offset : offset + words] = tensors[i].reshape(-1).view(torch.int32)
    return packed


def unpack_ints(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of a ``pack_ints`` buffer with the shapes and dtypes of the packed ``like`` tensors."""
    out: list[torch.Tensor] = list(like)
    for i, offset, words in _pack_layout(like):
        part = packed[offset : offset + words]
        out[i] = (part.view(torch.int64) if like[i].dtype == torch.int64 else part).view(like[i].shape)
    return out


def _pack_layout(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """``(tensor index, offset, int32 words)`` per tensor in the packed buffer, int64 tensors first."""
    for t in tensors:
        if t.dtype not in (torch.int32, torch.int64):
            raise SpecError(f"pack_ints: int32/int64 tensors only, got {t.dtype}")
    layout, offset = [], 0
    for i in sorted(range(len(tensors)), key=lambda i: tensors[i].dtype != torch.int64):
        words = tensors[i].numel() * (2 if tensors[i].dtype == torch.int64 else 1)
        layout.append((i, offset, words))
        offset += words
    return layout


def _check_slots_written_once(loc: torch.Tensor, page_size: int, slots: Sequence[int] | None = None) -> None:
    """No negative slot, and no slot written twice: two new tokens written to one slot would leave
    whichever the kernel happens to write last; only page 0, the padding page, takes any number
    of writes. ``slots``: ``loc``'s values, where the caller has them."""
    if loc.numel() == 0:
        return
    repeated = None
    if slots is not None or loc.numel() <= 4096:  # a decode or verify step: a set is cheaper than torch ops
        slots = loc.tolist() if slots is None else slots
        lowest = min(slots)
        seen: set[int] = set()
        for slot in slots:
            if slot >= page_size:
                if slot in seen:
                    repeated = slot
                    break
                seen.add(slot)
    else:
        lowest = int(loc.min())
        if lowest >= 0:
            slots_t, counts = torch.unique(loc[loc >= page_size], return_counts=True)
            if bool((counts > 1).any()):
                repeated = int(slots_t[counts > 1][0])
    if lowest < 0:
        raise SpecError(f"build_metadata: out_cache_loc has the negative slot {lowest}, expected slots >= 0")
    if repeated is not None:
        raise SpecError(f"build_metadata: out_cache_loc writes slot {repeated} more than once (only padding page 0 may repeat)")
