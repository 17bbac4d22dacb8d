"""The split-K/V paged pool layout, shared by every backend.

Backends subclass ``SplitKVPool`` and override only how a buffer is allocated
(``_allocate``) and how rows are written (``_write_rows``); the layout, the SWA
mapping and the validation live here once.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from hal.errors import CacheLocationError, KVLayoutError, PoolTooLargeError
from hal.graph import is_capturing
from hal.plan import call_signature
from hal.spec import KVPoolSpec, int_at_least, int_bounds

if TYPE_CHECKING:
    from hal.plan import ForwardPlan


class SplitKVPool:
    """K and V in separate buffers ``[layers, num_pages + 1, page_size, kv_heads, dim]``.

    Full layers and SWA layers live in separate sub-pools, each with page 0 reserved
    for padding. ``full_to_swa_page[p]`` is the SWA page backing full page ``p``
    (0 = unmapped; page 0 always maps to 0).
    """

    def __init__(
        self, spec: KVPoolSpec, device: torch.device | str = "cpu", *, storage: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> None:
        """``storage``: the (K, V) tensors of every layer, by layer id, when an engine owns the
        memory (one copy of the KV: the pool is a view of it); else the pool allocates its own."""
        self.spec = spec
        self.device = torch.device(device)
        self._passed_writes: set[Hashable] = set()  # kinds of forward write that passed _validate (ForwardPlan.check_once)
        full_ids = spec.full_layer_ids
        swa_ids = spec.swa.layer_ids if spec.swa is not None else ()
        # global layer id -> (sub-pool name, index inside that sub-pool)
        self._where: dict[int, tuple[str, int]] = {}
        for i, layer in enumerate(full_ids):
            self._where[layer] = ("full", i)
        for i, layer in enumerate(swa_ids):
            self._where[layer] = ("swa", i)
        self._k: dict[str, torch.Tensor] = {}
        self._v: dict[str, torch.Tensor] = {}
        shapes = spec.buffer_shapes()
        check_pool_size(spec, None)
        if storage is None:
            for name, (k_shape, v_shape) in shapes.items():
                self._k[name] = self._allocate(k_shape)
                self._v[name] = self._allocate(v_shape)
            # Per-layer views into the sub-pool tensors (no copies), indexed by global layer id.
            self._k_views = [self._k[self._where[i][0]][self._where[i][1]] for i in range(spec.num_layers)]
            self._v_views = [self._v[self._where[i][0]][self._where[i][1]] for i in range(spec.num_layers)]
        else:
            self._k_views, self._v_views = self._adopt(storage, shapes)
        # The same views as [slots, kv_heads, dim], the shape set_kv writes rows into.
        self._k_rows = [b.view(-1, *b.shape[2:]) for b in self._k_views]
        self._v_rows = [b.view(-1, *b.shape[2:]) for b in self._v_views]
        # Their wide-element views (see copy_rows), keyed by the row view's identity.
        self._wide_views = {id(b): _wide_rows(b) for b in self._k_rows + self._v_rows}
        # What a write's checks read of its layer (its dims and sub-pool): layers alike are checked once (ForwardPlan.check_once).
        self._layer_kinds = tuple((spec.layer_dims(i), self._where[i][0]) for i in range(spec.num_layers))
        self.full_to_swa_page: torch.Tensor | None = None
        # A host mirror of the mapping: slot checks read it without a device sync.
        self._full_to_swa_page_host: torch.Tensor | None = None
        if spec.swa is not None:
            self.full_to_swa_page = torch.zeros(spec.num_pages + 1, dtype=torch.int64, device=self.device)
            self._full_to_swa_page_host = torch.zeros(spec.num_pages + 1, dtype=torch.int64)

    # -- backend hooks -------------------------------------------------------------------
    def _allocate(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.spec.dtype, device=self.device)

    def _check_storage(self, buffer: torch.Tensor, where: str) -> None:
        """Refuse an engine-owned layer buffer this backend's kernels cannot address (layout,
        alignment); the core has checked its shape, dtype, device and contiguity."""

    # -- engine-owned storage ----------------------------------------------------------------
    def _adopt(
        self, storage: Sequence[tuple[torch.Tensor, torch.Tensor]], shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's (K, V) from ``storage``, checked: one layer each, the spec's shapes, dtype and
        device, contiguous (kernels read a layer as ``[slots, heads, dim]`` rows), no two overlapping."""
        if isinstance(storage, (str, bytes)) or not isinstance(storage, Sequence) or len(storage) != self.spec.num_layers:
            got = len(storage) if isinstance(storage, Sequence) else type(storage).__name__
            raise KVLayoutError(f"SplitKVPool storage: expected one (K, V) pair per layer ({self.spec.num_layers}), got {got}")
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        spans: list[tuple[int, int, str]] = []
        for layer, pair in enumerate(storage):
            sub = self._where[layer][0]
            for which, tensor, shape in zip("KV", pair, (s[1:] for s in shapes[sub])):
                where = f"SplitKVPool storage: layer {layer} {which}"
                if not isinstance(tensor, torch.Tensor):
                    raise KVLayoutError(f"{where} must be a tensor, got {type(tensor).__name__}")
                if tuple(tensor.shape) != shape or tensor.dtype != self.spec.dtype or tensor.device != self.device:
                    raise KVLayoutError(
                        f"{where} is {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}; expected {self.spec.dtype} "
                        f"{shape} ([pages + 1, page_size, kv_heads, dim]) on {self.device}"
                    )
                if not tensor.is_contiguous():
                    raise KVLayoutError(f"{where} has strides {tensor.stride()}; hal's kernels read a contiguous layer buffer")
                self._check_storage(tensor, where)
                start = tensor.data_ptr()
                spans.append((start, start + tensor.numel() * tensor.element_size(), f"layer {layer} {which}"))
                (ks if which == "K" else vs).append(tensor)
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise KVLayoutError(f"SplitKVPool storage: {first} and {second} overlap; every buffer needs memory of its own")
        return ks, vs

    def _write_rows(self, buffer: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
        """``buffer[loc[i]] = rows[i]``; ``buffer`` is a layer viewed as ``[slots, heads, dim]``."""
        copy_rows(buffer, loc, rows, wide_buffer=self._wide_views.get(id(buffer)))

    # -- layout ----------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> None:
        int_at_least(layer, 0, "layer", KVLayoutError, maximum=self.spec.num_layers - 1)

    def k_buffer(self, layer: int) -> torch.Tensor:
        """``[num_pages + 1, page_size, kv_heads, head_dim]`` view of one layer's K."""
        self._check_layer(layer)
        return self._k_views[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """``[num_pages + 1, page_size, kv_heads, v_head_dim]`` view of one layer's V."""
        self._check_layer(layer)
        return self._v_views[layer]

    @property
    def k_buffers(self) -> list[torch.Tensor]:
        """Every layer's K view, indexed by layer id."""
        return list(self._k_views)

    @property
    def v_buffers(self) -> list[torch.Tensor]:
        """Every layer's V view, indexed by layer id."""
        return list(self._v_views)

    def sub_pool_buffers(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The contiguous (K, V) tensors of each sub-pool, e.g. for disaggregated transfer. A pool
        over engine-owned storage has none: the engine holds (and transfers) its own memory."""
        if not self._k:
            raise KVLayoutError("sub_pool_buffers: this pool is a view of engine-owned storage, one buffer per layer")
        return {name: (self._k[name], self._v[name]) for name in self._k}

    def is_swa_layer(self, layer: int) -> bool:
        """Whether the layer lives in the SWA sub-pool."""
        self._check_layer(layer)
        return self._where[layer][0] == "swa"

    def bytes_per_token(self) -> int:
        """K + V bytes one token takes, summed over all layers."""
        return self.spec.bytes_per_token()

    def num_slots(self, layer: int) -> int:
        """Slots addressable in the layer's sub-pool, padding page included."""
        self._check_layer(layer)
        return self._k_views[layer].shape[0] * self.spec.page_size

    # -- SWA mapping -----------------------------------------------------------------------
    def map_swa_pages(self, full_pages: torch.Tensor, swa_pages: torch.Tensor) -> None:
        """Back full pages with SWA pages (called by the allocator)."""
        if self.full_to_swa_page is None:
            raise KVLayoutError("map_swa_pages: this pool has no SWA part")
        full_pages = torch.as_tensor(full_pages, dtype=torch.int64, device=self.device).reshape(-1)
        swa_pages = torch.as_tensor(swa_pages, dtype=torch.int64, device=self.device).reshape(-1)
        if full_pages.shape != swa_pages.shape:
            raise KVLayoutError(
                f"map_swa_pages: {full_pages.numel()} full pages but {swa_pages.numel()} SWA pages"
            )
        if full_pages.numel():
            if int(full_pages.min()) < 1 or int(full_pages.max()) > self.spec.num_pages:
                raise CacheLocationError(f"map_swa_pages: full pages must lie in 1..{self.spec.num_pages}")
            if int(swa_pages.min()) < 1 or int(swa_pages.max()) > self.spec.swa_num_pages:
                raise CacheLocationError(f"map_swa_pages: SWA pages must lie in 1..{self.spec.swa_num_pages}")
        self.full_to_swa_page[full_pages] = swa_pages
        assert self._full_to_swa_page_host is not None
        self._full_to_swa_page_host[full_pages.cpu()] = swa_pages.cpu()

    def unmap_swa_pages(self, full_pages: torch.Tensor) -> None:
        """Drop the SWA backing of full pages (called by the allocator on free)."""
        if self.full_to_swa_page is None:
            raise KVLayoutError("unmap_swa_pages: this pool has no SWA part")
        full_pages = torch.as_tensor(full_pages, dtype=torch.int64, device=self.device).reshape(-1)
        if full_pages.numel() and (int(full_pages.min()) < 0 or int(full_pages.max()) > self.spec.num_pages):
            raise CacheLocationError(f"unmap_swa_pages: full pages must lie in 0..{self.spec.num_pages}")
        self.full_to_swa_page[full_pages] = 0
        assert self._full_to_swa_page_host is not None
        self._full_to_swa_page_host[full_pages.cpu()] = 0

    def swa_block_table(self, block_table: torch.Tensor) -> torch.Tensor:
        """Translate a full-pool block table to SWA pages (padding page 0 stays 0)."""
        if self.full_to_swa_page is None:
            raise KVLayoutError("swa_block_table: this pool has no SWA part")
        return self.full_to_swa_page[block_table.long()].to(block_table.dtype)

    def translate_loc(self, layer: int, loc: torch.Tensor) -> torch.Tensor:
        """Full-pool slots -> slots in the layer's own sub-pool."""
        self._check_layer(layer)
        if not self.is_swa_layer(layer):
            return loc
        assert self.full_to_swa_page is not None
        ps = self.spec.page_size
        return self.full_to_swa_page[torch.div(loc, ps, rounding_mode="floor")] * ps + loc % ps

    # -- writes ----------------------------------------------------------------------------
    def _validate(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Types, shapes, dtypes and devices of a write (slot values are checked by the caller)."""
        self._check_layer(layer)
        heads, dk, dv = self.spec.layer_dims(layer)
        if not isinstance(loc, torch.Tensor) or loc.dim() != 1 or loc.dtype not in (torch.int32, torch.int64):
            desc = f"{loc.dtype} tensor of shape {tuple(loc.shape)}" if isinstance(loc, torch.Tensor) else type(loc).__name__
            raise KVLayoutError(f"set_kv: loc must be a 1-D int32/int64 tensor, got {desc}")
        n = loc.shape[0]
        for name, x, d in (("k", k, dk), ("v", v, dv)):
            if not isinstance(x, torch.Tensor):
                raise KVLayoutError(f"set_kv layer {layer}: {name} must be a tensor, got {type(x).__name__}")
            if tuple(x.shape) != (n, heads, d):
                raise KVLayoutError(
                    f"set_kv layer {layer}: {name} has shape {tuple(x.shape)}, expected ({n}, {heads}, {d})"
                )
            if x.dtype != self.spec.dtype:
                raise KVLayoutError(f"set_kv layer {layer}: {name} has dtype {x.dtype}, the pool stores {self.spec.dtype}")
            if x.device != self.device:
                raise KVLayoutError(f"set_kv layer {layer}: {name} is on {x.device}, the pool is on {self.device}")
        if loc.device != self.device:
            raise KVLayoutError(f"set_kv layer {layer}: loc is on {loc.device}, the pool is on {self.device}")

    # -- host-side checks of slot and page ids ---------------------------------------------
    def check_slots(self, loc: torch.Tensor, where: str, *, swa: bool | None = None) -> None:
        """Raise ``CacheLocationError`` unless every full-pool slot in the host tensor ``loc`` lies in
        the pool and, for SWA-pool writes (``swa``; default: whenever the pool has an SWA part), in a
        page with an SWA page mapped. Page 0, the padding page, is always writable."""
        if loc.numel() == 0:
            return
        loc = loc if loc.dim() == 1 else loc.reshape(-1)
        limit = (self.spec.num_pages + 1) * self.spec.page_size
        lo, hi = int_bounds(loc)
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise CacheLocationError(f"{where}: cache location {bad} out of range [0, {limit})")
        if swa is None:
            swa = self._full_to_swa_page_host is not None
        if swa:
            assert self._full_to_swa_page_host is not None
            pages = torch.div(loc, self.spec.page_size, rounding_mode="floor")
            unmapped = (pages != 0) & (self._full_to_swa_page_host[pages] == 0)
            if bool(unmapped.any()):
                first = int(loc[unmapped][0])
                raise CacheLocationError(
                    f"{where}: cache location {first} lies in full page "
                    f"{first // self.spec.page_size}, which has no SWA page mapped"
                )

    def check_pages(self, pages: torch.Tensor, where: str) -> None:
        """Raise ``CacheLocationError`` unless every page id in the host tensor ``pages`` is in ``0..num_pages``."""
        if pages.numel() == 0:
            return
        lo, hi = int_bounds(pages)
        if lo < 0 or hi > self.spec.num_pages:
            bad = lo if lo < 0 else hi
            raise CacheLocationError(f"{where}: page id {bad} outside the pool's pages 0..{self.spec.num_pages}")

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k[i], v[i]`` at full-pool slot ``loc[i]`` of ``layer``; validates before writing
        (slot values too, reading ``loc`` back, except inside a graph capture where that would sync)."""
        self._validate(layer, loc, k, v)
        if loc.shape[0] and not is_capturing():
            self.check_slots(loc.cpu(), f"set_kv layer {layer}", swa=self.is_swa_layer(layer))
        self._write_slots(layer, self.translate_loc(layer, loc.long()), k, v)

    def set_kv_for_forward(self, layer: int, plan: ForwardPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """``set_kv`` at the plan's ``out_cache_loc``, whose slots the plan step checked once."""
        self._write_slots(layer, self.slots_for_forward(layer, plan, k, v), k, v)

    def slots_for_forward(self, layer: int, plan: ForwardPlan, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The int64 slots of the layer's own sub-pool that ``set_kv_for_forward`` writes ``k`` and
        ``v`` to, after its checks (for a kernel that writes the rows as it attends)."""
        if not plan.usable_by(self):
            plan.check_usable(self, f"set_kv_for_forward layer {layer}")
        loc = plan.metadata.out_cache_loc
        kind = self._layer_kinds[layer] if type(layer) is int and 0 <= layer < len(self._layer_kinds) else None
        signature = call_signature("kv-write", k, v)
        plan.check_once(None if kind is None or signature is None else (signature, kind), self._validate, layer, loc, k, v,
                        passed=self._passed_writes)
        return plan.per_layer_kind(("pool-slots", self.is_swa_layer(layer)), self._slots_of_layer, layer, loc)

    def _slots_of_layer(self, layer: int, loc: torch.Tensor) -> torch.Tensor:
        # int64 already (build_metadata's): no conversion op, which is not free on a step's first layer
        return self.translate_loc(layer, loc if loc.dtype is torch.int64 else loc.long())

    def _write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V rows at ``slots`` of the layer's own sub-pool (already translated and checked)."""
        self._write_rows(self._k_rows[layer], slots, k)
        self._write_rows(self._v_rows[layer], slots, v)


# The most elements one tensor may hold: torch counts storage bytes in an int64.
_MAX_TENSOR_BYTES = 2**63 - 1


def check_pool_size(spec: KVPoolSpec, device_bytes: int | None) -> None:
    """Raise ``PoolTooLargeError`` naming the bytes ``spec`` needs when one of its buffers cannot
    be a tensor, or (``device_bytes``: the device's memory, when known) when they exceed it."""
    need = spec.pool_bytes()
    elem = torch.empty((), dtype=spec.dtype).element_size()
    for name, pair in spec.buffer_shapes().items():
        for shape in pair:
            if math.prod(shape) * elem > _MAX_TENSOR_BYTES:
                raise PoolTooLargeError(
                    f"KV pool of {spec.size} tokens: its {name} buffer {shape} would take {math.prod(shape) * elem} bytes, "
                    f"more than a tensor can hold ({_MAX_TENSOR_BYTES}); the pool needs {need} bytes in all"
                )
    if device_bytes is not None and need > device_bytes:
        raise PoolTooLargeError(
            f"KV pool of {spec.size} tokens needs {need} bytes ({need / 2**30:.1f} GiB), "
            f"more than the device's {device_bytes} bytes ({device_bytes / 2**30:.1f} GiB)"
        )


# index_copy_ moves one element at a time: rows reinterpreted as 16-byte elements copy the same
# bytes bit for bit, up to 1.7x faster than 2-byte bf16 or 4-byte fp32 elements.
_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32)


# Below this many rows (a decode step's few tokens) finding the wide view costs more than it saves.
_WIDE_MIN_ROWS = 16


def copy_rows(buffer: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor, *, wide_buffer: torch.Tensor | None = None) -> None:
    """``buffer[loc[i]] = rows[i]`` by ``index_copy_``, on rows read as wide elements where both
    sides allow it (bit for bit the same bytes). ``wide_buffer``: ``buffer``'s wide view, if known."""
    if rows.shape[0] < _WIDE_MIN_ROWS:
        buffer.index_copy_(0, loc, rows)
        return
    wide = (_wide_rows(buffer) if wide_buffer is None else wide_buffer), _wide_rows(rows)
    if wide[0] is not None and wide[1] is not None and wide[0].dtype == wide[1].dtype:
        wide[0].index_copy_(0, loc, wide[1])
    else:
        buffer.index_copy_(0, loc, rows)


def _wide_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as ``[rows, n]`` of the widest dtype that tiles each row exactly, or None when its
    rows are not contiguous (the caller then copies element by element)."""
    if x.dim() == 0 or x.shape[0] == 0 or x.dtype.is_complex:
        return None
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    for dtype in _WIDE_DTYPES:
        if dtype.itemsize <= x.element_size():
            return None
        if row_bytes % dtype.itemsize == 0:
            try:
                return x.view(x.shape[0], -1).view(dtype)
            except RuntimeError:  # strided rows, or a storage offset the wide dtype cannot address
                continue
    return None
