"""Page allocation: a state machine against a model of which pages are live."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hal.allocator import KVAllocator, PageAllocator, RequestPageTable
from hal.errors import CacheLocationError, OutOfPagesError, SpecError
from hal.kv_pool import SplitKVPool
from hal.spec import KVPoolSpec, SWAPoolSpec

CHEAP = settings.get_profile("hal-cheap")


class PageTableMachine(RuleBasedStateMachine):
    """Requests grow, shrink to nothing and misbehave; the model is a dict of live pages."""

    @initialize(
        num_pages=st.integers(1, 12),
        page_size=st.sampled_from([1, 2, 4, 16]),
        swa_pages=st.one_of(st.none(), st.integers(1, 12)),
    )
    def setup(self, num_pages: int, page_size: int, swa_pages: int | None) -> None:
        swa = None if swa_pages is None else SWAPoolSpec((0,), swa_pages * page_size, 1, 2, 2)
        self.spec = KVPoolSpec(2, num_pages * page_size, page_size, 1, 2, 2, swa=swa)
        self.pool = SplitKVPool(self.spec)
        self.allocator = KVAllocator(self.pool)
        self.table = RequestPageTable(self.allocator)
        self.capacity = num_pages if swa_pages is None else min(num_pages, swa_pages)
        self.model: dict[int, list[int]] = {}  # request -> pages, as the test expects them

    def live_pages(self) -> list[int]:
        return [p for pages in self.model.values() for p in pages]

    @rule(request=st.integers(0, 5), tokens=st.integers(0, 40))
    def reserve(self, request: int, tokens: int) -> None:
        have = self.model.get(request, [])
        need = max(0, -(-tokens // self.spec.page_size) - len(have))
        free_before = self.allocator.num_free_pages
        if need > free_before:
            with pytest.raises(OutOfPagesError, match=f"asked for {need} pages"):
                self.table.reserve(request, tokens)
            assert self.allocator.num_free_pages == free_before  # nothing half-allocated
            return
        free = sorted(set(range(1, self.spec.num_pages + 1)) - set(self.live_pages()))
        swa_free = None
        if self.pool.full_to_swa_page is not None:
            mapping = self.pool.full_to_swa_page.tolist()
            swa_free = sorted(set(range(1, self.spec.swa_num_pages + 1)) - {mapping[p] for p in self.live_pages()})
        self.table.reserve(request, tokens)
        new = self.table.pages(request)[len(have) :]
        assert len(new) == need
        assert not set(new) & set(self.live_pages()), "a live page was handed out again"
        # The lowest free pages in order, however pages were freed: a drained pool hands out runs.
        assert new == free[:need]
        if swa_free is not None:
            assert [int(self.pool.full_to_swa_page[p]) for p in new] == swa_free[:need]
        self.model[request] = have + new
        assert self.table.capacity(request) >= tokens

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data) -> None:
        request = data.draw(st.sampled_from(sorted(self.model)))
        self.table.release(request)
        del self.model[request]
        assert request not in self.table

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def slots_match_pages(self, data) -> None:
        request = data.draw(st.sampled_from(sorted(self.model)))
        pages, ps = self.model[request], self.spec.page_size
        positions = data.draw(st.lists(st.integers(0, len(pages) * ps - 1), max_size=8)) if pages else []
        got = self.table.slots(request, positions).tolist()
        assert got == [pages[p // ps] * ps + p % ps for p in positions]
        with pytest.raises(CacheLocationError, match=f"request {request} has {len(pages) * ps} reserved positions"):
            self.table.slots(request, [len(pages) * ps])

    @precondition(lambda self: self.model and any(self.model.values()))
    @rule(data=st.data())
    def double_free_raises_and_changes_nothing(self, data) -> None:
        page = data.draw(st.sampled_from(self.live_pages()))
        dead = [p for p in range(1, self.spec.num_pages + 1) if p not in self.live_pages()]
        bad = data.draw(st.sampled_from([[page, page], [0], [self.spec.num_pages + 1], [-1], *([[d] for d in dead])]))
        free_before = (self.allocator.full.num_free, self.allocator.swa.num_free if self.allocator.swa else None)
        mapping_before = None if self.pool.full_to_swa_page is None else self.pool.full_to_swa_page.clone()
        with pytest.raises(CacheLocationError, match="not allocated"):
            self.allocator.free(bad)
        assert (self.allocator.full.num_free, self.allocator.swa.num_free if self.allocator.swa else None) == free_before
        if mapping_before is not None:
            assert torch.equal(self.pool.full_to_swa_page, mapping_before)

    @invariant()
    def counts_and_ranges(self) -> None:
        if not hasattr(self, "model"):
            return
        live = self.live_pages()
        assert len(set(live)) == len(live)
        assert all(1 <= p <= self.spec.num_pages for p in live), "page 0 or out-of-range page handed out"
        assert self.allocator.full.num_free == self.spec.num_pages - len(live)
        assert self.allocator.num_free_pages == self.capacity - len(live)
        for request, pages in self.model.items():
            assert self.table.pages(request) == pages
        if self.allocator.swa is not None:
            mapping = self.pool.full_to_swa_page.tolist()
            swa = [mapping[p] for p in live]
            assert all(s >= 1 for s in swa) and len(set(swa)) == len(swa)
            assert self.allocator.swa.num_free == self.spec.swa_num_pages - len(live)

    def teardown(self) -> None:
        if not hasattr(self, "model"):
            return
        for request in list(self.model):
            self.table.release(request)
        # Releasing everything returns the pool to full, mapping cleared.
        assert self.allocator.num_free_pages == self.capacity
        assert self.allocator.full.num_free == self.spec.num_pages
        if self.pool.full_to_swa_page is not None:
            assert int(self.pool.full_to_swa_page.abs().sum()) == 0


PageTableMachine.TestCase.settings = CHEAP
test_page_table_state_machine = PageTableMachine.TestCase


def test_page_allocator_hands_out_low_pages_and_never_page_zero() -> None:
    alloc = PageAllocator(4)
    assert alloc.alloc(0) == []
    assert alloc.alloc(3) == [1, 2, 3]
    alloc.free([2])
    assert alloc.num_free == 2
    assert alloc.alloc(2) == [2, 4]
    alloc.free([3, 1, 2])  # freed in any order, handed out lowest first
    assert alloc.alloc(3) == [1, 2, 3]
    with pytest.raises(OutOfPagesError, match="asked for 1 pages, 0 of 4 free"):
        alloc.alloc(1)


@pytest.mark.parametrize("n", [-1, 1.5, "2"])
def test_page_allocator_rejects_bad_counts(n) -> None:
    alloc = PageAllocator(4)
    with pytest.raises(SpecError, match="page count must be an int >= 0"):
        alloc.alloc(n)
    assert alloc.num_free == 4


@pytest.mark.parametrize("n", [-3, True, 2.0, None])
def test_page_allocator_refuses_a_size_that_is_not_a_page_count(n) -> None:
    with pytest.raises(SpecError, match=f"PageAllocator: num_pages must be an int >= 0, got {n!r}"):
        PageAllocator(n)


def test_hybrid_allocator_is_limited_by_the_smaller_sub_pool() -> None:
    spec = KVPoolSpec(2, 32, 4, 1, 2, 2, swa=SWAPoolSpec((1,), 8, 1, 2, 2))  # 8 full pages, 2 SWA pages
    alloc = KVAllocator(SplitKVPool(spec))
    assert alloc.num_pages == 2 and alloc.num_free_pages == 2
    with pytest.raises(OutOfPagesError, match="asked for 3 pages, 2 free"):
        alloc.alloc(3)
    assert alloc.full.num_free == 8  # the failed request took no full page either
    pages = alloc.alloc(2)
    assert alloc.pool.full_to_swa_page[torch.tensor(pages)].tolist() == [1, 2]
    alloc.free(pages)
    assert alloc.num_free_pages == 2 and alloc.full.num_free == 8
    alloc.free([])  # freeing nothing is fine


def test_request_page_table_hand_case() -> None:
    table = RequestPageTable(KVAllocator(SplitKVPool(KVPoolSpec(1, 16, 4, 1, 2, 2))))
    table.reserve(7, 5)  # 2 pages: 1, 2
    table.reserve(9, 1)  # 1 page: 3
    table.reserve(7, 6)  # still fits in 2 pages
    assert table.pages(7) == [1, 2] and table.pages(9) == [3]
    assert table.slots(7, [0, 3, 4, 5]).tolist() == [4, 7, 8, 9]
    assert table.table([9, 7, 8]) == [[3], [1, 2], []]
    assert table.capacity(8) == 0
    table.release(7)
    table.release(8)  # unknown request: nothing to return
    assert table.allocator.num_free_pages == 3
