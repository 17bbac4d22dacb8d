"""Host-side page allocation for a ``KVPool``, and a per-request page table on top of it."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import torch

from hal.errors import CacheLocationError, OutOfPagesError, SpecError
from hal.protocols import KVPool
from hal.spec import int_at_least, strict_int, strict_ints


def _page_count(n: object, what: str = "alloc: page count") -> int:
    return int_at_least(n, 0, what)


class PageAllocator:
    """Free pages ``1..num_pages`` (page 0 is the padding page, never handed out), handed out lowest
    first whatever order they were freed in: requests admitted together into a drained pool get
    consecutive pages, which a kernel can read in place instead of gathering them."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = _page_count(num_pages, "PageAllocator: num_pages")
        self._free = list(range(1, num_pages + 1))  # a heap: heappop hands out the lowest page
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Pages that can still be handed out."""
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free pages, lowest first; raises ``OutOfPagesError`` (and takes none) when fewer are free."""
        n = _page_count(n)
        if n > len(self._free):
            raise OutOfPagesError(f"alloc: asked for {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return allocated pages; a page not allocated (or listed twice) raises and frees nothing."""
        pages = list(strict_ints(pages, "free: pages"))
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise CacheLocationError(f"free: pages {bad or pages} are not allocated (double free?)")
        self._used.difference_update(pages)
        for page in pages:
            heapq.heappush(self._free, page)


class KVAllocator:
    """Allocates full-pool pages and, on a hybrid pool, the SWA pages that back them."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.full = PageAllocator(pool.spec.num_pages)
        self.swa = PageAllocator(pool.spec.swa_num_pages) if pool.spec.swa is not None else None

    @property
    def page_size(self) -> int:
        """Tokens per page of the pool."""
        return self.pool.spec.page_size

    @property
    def num_free_pages(self) -> int:
        """Full pages that can still be allocated (on a hybrid pool, also limited by free SWA pages)."""
        if self.swa is None:
            return self.full.num_free
        return min(self.full.num_free, self.swa.num_free)

    @property
    def num_pages(self) -> int:
        """Allocatable pages in all (page 0, the padding page, excluded)."""
        if self.swa is None:
            return self.full.num_pages
        return min(self.full.num_pages, self.swa.num_pages)

    def alloc(self, n: int) -> list[int]:
        """``n`` full-pool pages; on a hybrid pool each is backed by a fresh SWA page in the pool's mapping."""
        n = _page_count(n)
        if n > self.num_free_pages:
            raise OutOfPagesError(f"alloc: asked for {n} pages, {self.num_free_pages} free")
        pages = self.full.alloc(n)
        if self.swa is not None and n:
            swa_pages = self.swa.alloc(n)
            self.pool.map_swa_pages(torch.tensor(pages), torch.tensor(swa_pages))
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return full-pool pages and unmap (and free) the SWA pages behind them."""
        pages = list(pages)
        if not pages:
            return
        if self.swa is not None:
            self.full.free(pages)  # validates first: the mapping lookup below needs allocated pages
            mapping = self.pool.full_to_swa_page  # type: ignore[attr-defined]
            swa_pages = mapping[torch.tensor(pages, device=mapping.device)].tolist()
            self.pool.unmap_swa_pages(torch.tensor(pages))
            self.swa.free(swa_pages)
        else:
            self.full.free(pages)


class RequestPageTable:
    """Each live request's pages, in token order; slot of position ``p`` = ``pages[p // ps] * ps + p % ps``."""

    def __init__(self, allocator: KVAllocator) -> None:
        self.allocator = allocator
        self._pages: dict[int, list[int]] = {}

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def pages(self, request: int) -> list[int]:
        """The request's pages in token order (KeyError for an unknown request)."""
        return self._pages[request]

    def capacity(self, request: int) -> int:
        """Positions the request's reserved pages hold (0 for an unknown request)."""
        return len(self._pages.get(request, ())) * self.page_size

    def reserve(self, request: int, num_tokens: int) -> None:
        """Make sure positions ``0 .. num_tokens - 1`` of ``request`` have slots; a reservation that
        cannot be met raises and leaves the table as it was (no entry for a new request)."""
        num_tokens = strict_int(num_tokens, "reserve: num_tokens")
        if num_tokens < 0:
            raise SpecError(f"reserve: num_tokens must be >= 0, got {num_tokens}")
        pages = self._pages.get(request, [])
        need = -(-num_tokens // self.page_size) - len(pages)
        new = self.allocator.alloc(need) if need > 0 else []
        self._pages[request] = pages + new

    def slots(self, request: int, positions: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Full-pool slots of ``positions``; a position beyond the reservation raises ``CacheLocationError``."""
        pos = strict_ints(positions, "slots: positions")
        if len(pos) <= self._HOST_LOOP_MAX:  # a step's few positions: cheaper in Python than as tensor ops
            return torch.tensor(self._host_slots(request, pos), dtype=torch.int64)
        pages = self._checked_pages(request, pos)
        at = torch.tensor(pos, dtype=torch.int64)
        ps = self.page_size
        return torch.tensor(pages, dtype=torch.int64)[torch.div(at, ps, rounding_mode="floor")] * ps + at % ps

    _HOST_LOOP_MAX = 64

    def slot_list(self, spans: Sequence[tuple[int, int, int]]) -> list[int]:
        """Full-pool slots of positions ``start .. end - 1`` of each ``(request, start, end)``, in
        order, as one list (a step's slots for ``build_metadata``); beyond a reservation raises
        ``CacheLocationError``."""
        return [slot for request, start, end in spans for slot in self._host_slots(request, range(start, end))]

    def _host_slots(self, request: int, positions: Sequence[int]) -> list[int]:
        """``slots`` of a few positions, computed in Python."""
        pages, ps = self._checked_pages(request, positions), self.page_size
        return [pages[p // ps] * ps + p % ps for p in positions]

    def _checked_pages(self, request: int, positions: Sequence[int]) -> list[int]:
        """The request's pages, once every position is known to lie in them (else ``CacheLocationError``)."""
        pages = self._pages.get(request, [])
        limit = len(pages) * self.page_size
        if positions and (min(positions) < 0 or max(positions) >= limit):
            raise CacheLocationError(f"slots: request {request} has {limit} reserved positions, asked for {list(positions)}")
        return pages

    def release(self, request: int) -> None:
        """Free all of the request's pages (no-op for an unknown request)."""
        self.allocator.free(self._pages.pop(request, []))

    def table(self, requests: Sequence[int]) -> list[list[int]]:
        """Page lists of ``requests``, the ragged block table ``build_metadata`` takes."""
        return [list(self._pages.get(r, [])) for r in requests]

    def __contains__(self, request: int) -> bool:
        return request in self._pages
