"""build_metadata and pad_metadata against brute-force per-request construction."""

from __future__ import annotations

import random

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hal.errors import SpecError
from hal.kv_pool import SplitKVPool
from hal.graph_runner import pad_metadata
import hal.metadata as metadata_module
from hal.metadata import AttentionMetadata, build_metadata
from hal.spec import ForwardMode, KVPoolSpec, SWAPoolSpec

CHEAP = settings.get_profile("hal-cheap")
M = ForwardMode
UNIFORM_MODES = [M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND_V2]


@st.composite
def batches(draw: st.DrawFn, modes: tuple[ForwardMode, ...] = (M.EXTEND, *UNIFORM_MODES), max_batch: int = 6):
    """(mode, page_size, kv_lens, q_lens, page rows, num_pages) with pages scattered over a pool."""
    mode = draw(st.sampled_from(modes))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    b = draw(st.integers(0, max_batch))
    longest = 4 * page_size + 3  # crosses several page boundaries
    if mode is M.EXTEND:
        kv = draw(st.lists(st.integers(0, longest), min_size=b, max_size=b))
        q = [draw(st.integers(0, n)) for n in kv]
    else:
        q_len = 1 if mode is M.DECODE else draw(st.integers(1, 6))
        kv = draw(st.lists(st.integers(q_len, longest + q_len), min_size=b, max_size=b))
        q = [q_len] * b
    need = [-(-n // page_size) for n in kv]
    extra = [draw(st.integers(0, 2)) for _ in kv]  # rows may list more pages than needed
    num_pages = sum(need) + sum(extra) + draw(st.integers(0, 3))
    order = list(range(1, num_pages + 1))
    random.Random(draw(st.integers(0, 2**32 - 1))).shuffle(order)  # pages scattered, not contiguous
    rows, at = [], 0
    for n, e in zip(need, extra):
        rows.append(list(order[at : at + n + e]))
        at += n + e
    return mode, page_size, kv, q, rows, num_pages


def brute_force(kv: list[int], q: list[int], rows: list[list[int]], page_size: int, max_pages: int | None):
    cu, positions, acc = [0], [], 0
    for n, ql in zip(kv, q):
        acc += ql
        cu.append(acc)
        for i in range(ql):
            positions.append(n - ql + i)
    width = max_pages if max_pages is not None else max([-(-n // page_size) for n in kv] + [1])
    table = [[row[i] if i < len(row) else 0 for i in range(width)] for row in rows]
    return cu, positions, table


def slots_for(kv: list[int], q: list[int], rows: list[list[int]], page_size: int) -> list[int]:
    out = []
    for n, ql, row in zip(kv, q, rows):
        for p in range(n - ql, n):
            out.append(row[p // page_size] * page_size + p % page_size)
    return out


@CHEAP
@given(batch=batches(), data=st.data())
def test_build_metadata_matches_brute_force(batch, data) -> None:
    mode, ps, kv, q, rows, _ = batch
    need = max([-(-n // ps) for n in kv] + [1])
    max_pages = data.draw(st.one_of(st.none(), st.integers(need, need + 3)))
    as_tensors = data.draw(st.booleans())
    loc = slots_for(kv, q, rows, ps)
    kwargs = dict(kv_lens=kv, q_lens=q, page_table=rows, out_cache_loc=loc)
    if as_tensors and rows and len({len(r) for r in rows}) == 1:
        ints = dict(dtype=torch.int64)  # an empty list would otherwise make a float tensor
        kwargs = dict(
            kv_lens=torch.tensor(kv, **ints), q_lens=torch.tensor(q, **ints), page_table=torch.tensor(rows, **ints),
            out_cache_loc=torch.tensor(loc, **ints),
        )
    md = build_metadata(mode, page_size=ps, max_pages=max_pages, **kwargs)

    cu, positions, table = brute_force(kv, q, rows, ps, max_pages)
    assert md.mode is mode and md.page_size == ps
    assert md.batch_size == len(kv) and md.num_tokens == sum(q)
    assert md.kv_lens_cpu == tuple(kv) and md.q_lens_cpu == tuple(q)
    assert md.cu_q_lens.tolist() == cu
    assert md.cu_q_lens_cpu == tuple(cu[1:])
    assert md.kv_lens.tolist() == kv and md.q_lens.tolist() == q
    assert md.positions.tolist() == positions
    assert md.out_cache_loc.tolist() == loc
    assert md.block_table.tolist() == (table if kv else [])
    assert md.swa_block_table is None
    assert (md.kv_lens.dtype, md.q_lens.dtype, md.cu_q_lens.dtype) == (torch.int32,) * 3
    assert (md.positions.dtype, md.out_cache_loc.dtype, md.block_table.dtype) == (torch.int64, torch.int64, torch.int32)
    assert set(md.tensors()) == {"kv_lens", "q_lens", "cu_q_lens", "positions", "out_cache_loc", "block_table"}
    assert_passes_the_constructors_checks(md)


def assert_passes_the_constructors_checks(md: AttentionMetadata) -> None:
    """build_metadata makes its record without the constructor's checks (they hold by construction):
    the public constructor takes the same fields without a refusal, and keeps them as they are."""
    fields = {field.name: getattr(md, field.name) for field in attrs.fields(AttentionMetadata)}
    again = AttentionMetadata(**fields)
    assert all(getattr(again, name) is value or getattr(again, name) == value for name, value in fields.items())


@CHEAP
@given(batch=batches(), data=st.data())
def test_swa_block_table_goes_through_the_pool_mapping(batch, data) -> None:
    mode, ps, kv, q, rows, num_pages = batch
    num_pages = max(num_pages, 1)
    swa_pages = data.draw(st.integers(1, num_pages))
    spec = KVPoolSpec(2, num_pages * ps, ps, 1, 4, 4, swa=SWAPoolSpec((1,), swa_pages * ps, 1, 4, 4))
    pool = SplitKVPool(spec)
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    full, swa = rng.sample(range(1, num_pages + 1), num_pages), rng.sample(range(1, swa_pages + 1), swa_pages)
    n = data.draw(st.integers(0, swa_pages))
    mapping = dict(zip(full[:n], swa[:n]))
    if mapping:
        pool.map_swa_pages(torch.tensor(list(mapping)), torch.tensor(list(mapping.values())))
    # The new tokens go to the padding page: pages without an SWA page may not take writes.
    md = build_metadata(mode, kv_lens=kv, q_lens=q, page_table=rows, out_cache_loc=[0] * sum(q), pool=pool)

    _, _, table = brute_force(kv, q, rows, ps, None)
    assert md.page_size == ps and md.block_table.device == pool.device
    assert md.block_table.tolist() == (table if kv else [])
    assert md.swa_block_table is not None
    assert md.swa_block_table.dtype == md.block_table.dtype
    assert md.swa_block_table.tolist() == [[mapping.get(p, 0) for p in row] for row in (table if kv else [])]
    assert "swa_block_table" in md.tensors()
    assert_passes_the_constructors_checks(md)


def _md(mode=M.EXTEND, kv=(5, 3), q=(2, 3), rows=((1, 2), (3,)), ps=4, **kwargs) -> AttentionMetadata:
    loc = kwargs.pop("out_cache_loc", list(range(sum(q))))
    return build_metadata(mode, kv_lens=list(kv), q_lens=list(q), page_table=[list(r) for r in rows],
                          out_cache_loc=loc, page_size=ps, **kwargs)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(kv=(5, 2), q=(2, 3)), r"request 1: need 0 <= q_len <= kv_len, got q_len=3, kv_len=2"),
        (dict(kv=(5, 3), q=(-1, 3)), r"request 0: need 0 <= q_len <= kv_len, got q_len=-1"),
        (dict(kv=(5,), q=(2, 3), rows=((1, 2),)), r"2 q_lens but 1 kv_lens"),
        (dict(rows=((1, 2),)), r"page_table has 1 rows for 2 requests"),
        (dict(rows=((1,), (3,))), r"request 0 has kv_len 5 but only 1 pages of 4"),
        (dict(max_pages=1), r"max_pages=1 is below the 2 pages"),
        (dict(max_pages=0), r"max_pages must be an int >= 1, got 0"),  # was taken as 1
        (dict(max_pages=-3), r"max_pages must be an int >= 1, got -3"),
        (dict(mode=M.DECODE, kv=(5, 3), q=(1, 2)), r"DECODE needs q_len 1"),
        (dict(mode=M.TARGET_VERIFY, kv=(5, 3), q=(2, 3)), r"TARGET_VERIFY needs the same q_len"),
        (dict(mode=M.DRAFT_EXTEND_V2, kv=(5, 3), q=(3, 2)), r"DRAFT_EXTEND_V2 needs the same q_len"),
        (dict(out_cache_loc=[0, 1, 2, 3]), r"out_cache_loc has shape \(4,\), expected \(5,\)"),
        (dict(rows=((1, -2), (3,))), r"page_table row 0 has page ids \[-2\]"),
        (dict(ps=None), r"needs page_size"),
    ],
)
def test_build_metadata_errors_name_the_field(kwargs, fragment: str) -> None:
    with pytest.raises(SpecError, match=fragment):
        _md(**kwargs)


def test_page_ids_beyond_the_pool_are_rejected() -> None:
    pool = SplitKVPool(KVPoolSpec(1, 12, 4, 1, 2, 2))  # pages 1..3
    with pytest.raises(SpecError, match=r"page_table row 1 has page ids \[4\], expected 0\.\.3"):
        build_metadata(M.EXTEND, kv_lens=[4, 4], q_lens=[1, 1], page_table=[[3], [4]], out_cache_loc=[0, 1], pool=pool)


def test_wide_page_ids_are_checked_before_the_table_narrows_to_int32() -> None:
    """An engine's int64 table: 2**32 + 1 would read as page 1 once narrowed to int32's block table;
    it is refused by its own value, with a pool and without one. Columns past the pages the batch
    needs are not the metadata's (an engine's table is as wide as its longest request can grow)."""
    pool = SplitKVPool(KVPoolSpec(1, 12, 4, 1, 2, 2))  # pages 1..3
    wide = torch.tensor([[3, 0], [2**32 + 1, 0]])
    with pytest.raises(SpecError, match=rf"page_table row 1 has page ids \[{2**32 + 1}\], expected 0\.\.3"):
        build_metadata(M.EXTEND, kv_lens=[4, 4], q_lens=[1, 1], page_table=wide, out_cache_loc=[0, 1], pool=pool)
    with pytest.raises(SpecError, match=rf"page_table row 1 has page ids \[{1 - 2**32}\], expected >= 0"):
        build_metadata(M.EXTEND, kv_lens=[4, 4], q_lens=[1, 1], page_table=torch.tensor([[3, 0], [1 - 2**32, 0]]), out_cache_loc=[0, 1],
                       page_size=4)
    unused = torch.tensor([[3, 2**40], [2, 7]])  # column 1: no request reaches it
    md = build_metadata(M.EXTEND, kv_lens=[4, 4], q_lens=[1, 1], page_table=unused, out_cache_loc=[12, 8], pool=pool)
    assert md.block_table.tolist() == [[3], [2]]


# 3 x 50: the whole table read into lists; 10 x 50: its 10 x 8 used ids; 60 x 8: checked by tensor ops
@pytest.mark.parametrize("requests", [3, 10, 60])
def test_an_engines_wide_table_gives_the_same_record_and_refusals_either_way_it_is_read(requests: int) -> None:
    """An engine's block table is as wide as its longest request may grow: the columns a batch
    uses become the record's table (int32, a copy), and a page id out of the pool is refused by its
    row and value, whether the few used ids are read as lists or a larger table is checked with
    tensor ops."""
    rng = random.Random(requests)
    pool = SplitKVPool(KVPoolSpec(1, 4 * 600, 4, 1, 2, 2))  # pages 1..600
    owned = rng.sample(range(1, 601), 8 * requests)  # each page belongs to one request
    pages = [owned[8 * i : 8 * i + 8] for i in range(requests)]
    engine_table = torch.zeros(requests, 50, dtype=torch.int32)
    engine_table[:, :8] = torch.tensor(pages, dtype=torch.int32)
    engine_table[:, 8:] = 7777  # stale ids past the batch's columns: not the metadata's
    kv = [rng.randint(29, 32) for _ in range(requests)]  # 8 pages of 4 tokens each
    slots = [pages[i][(n - 1) // 4] * 4 + (n - 1) % 4 for i, n in enumerate(kv)]
    md = build_metadata(M.DECODE, kv_lens=kv, q_lens=[1] * requests, page_table=engine_table, out_cache_loc=slots, pool=pool)
    assert md.block_table.dtype == torch.int32 and md.block_table.tolist() == pages
    engine_table[0, 0] = -5  # the table the record holds is a copy
    assert md.block_table[0, 0] == pages[0][0]
    engine_table[0, 0] = pages[0][0]
    engine_table[requests - 1, 5] = 601
    with pytest.raises(SpecError, match=rf"page_table row {requests - 1} has page ids \[601\], expected 0\.\.600"):
        build_metadata(M.DECODE, kv_lens=kv, q_lens=[1] * requests, page_table=engine_table, out_cache_loc=slots, pool=pool)


def test_decode_steps_on_the_same_pages_share_their_table_and_every_record_keeps_its_values() -> None:
    """A decode step's block table and query lengths are the last step's as often as not: a build
    finds the tensors an earlier build made for the same values (``RECENT_TENSORS_LIMIT`` of them) and
    makes new ones for new values, and no later build changes what an earlier record holds."""
    pool = SplitKVPool(KVPoolSpec(1, 4 * 400, 4, 1, 2, 2))  # pages 1..400
    rng = random.Random(7)
    engine_table = torch.tensor([rng.sample(range(1, 401), 3) for _ in range(2)], dtype=torch.int32)

    def step(kv: list[int]) -> AttentionMetadata:
        slots = [int(engine_table[i, (n - 1) // 4]) * 4 + (n - 1) % 4 for i, n in enumerate(kv)]
        return build_metadata(M.DECODE, kv_lens=kv, q_lens=[1, 1], page_table=engine_table, out_cache_loc=slots, pool=pool)

    first, second = step([5, 6]), step([6, 7])  # both inside pages 0 and 1 of each request
    assert second.block_table is first.block_table and second.q_lens is first.q_lens and second.cu_q_lens is first.cu_q_lens
    assert second.kv_lens.tolist() == [6, 7] and first.kv_lens.tolist() == [5, 6]
    assert second.positions.tolist() == [5, 6] and first.positions.tolist() == [4, 5]
    later = step([9, 10])  # a third page each: another table
    assert later.block_table is not first.block_table and later.block_table.shape == (2, 3)
    assert later.block_table.tolist() == engine_table.tolist() and first.block_table.tolist() == engine_table[:, :2].tolist()
    original = engine_table[:, :2].tolist()
    records = []
    for _ in range(metadata_module.RECENT_TENSORS_LIMIT + 5):  # more distinct tables than are kept
        engine_table[0, 0] = rng.randrange(1, 401)
        records.append((step([5, 6]), engine_table[:, :2].tolist()))
    assert all(md.block_table.tolist() == pages for md, pages in records)
    assert len(metadata_module._recent) <= metadata_module.RECENT_TENSORS_LIMIT
    assert first.block_table.tolist() == original
    wide = [list(range(1, 2 + metadata_module.RECENT_TABLE_LIMIT))]  # more ids than a kept table may hold
    kept = len(metadata_module._recent)
    big = [build_metadata(M.EXTEND, kv_lens=[4 * len(wide[0])], q_lens=[1], page_table=wide, out_cache_loc=[4 * len(wide[0]) - 1],
                          page_size=4) for _ in range(2)]
    assert big[0].block_table is not big[1].block_table and big[1].block_table.tolist() == wide
    assert len(metadata_module._recent) <= max(kept, 1) + 1  # the query lengths' pair at most


def test_a_length_past_int32_is_refused_by_name() -> None:
    """Kernels read lengths as int32: a KV length of 2**31 is refused naming it, not wrapped or left
    to a torch overflow deep in the build."""
    with pytest.raises(SpecError, match=rf"build_metadata: kv_lens: {2**31} does not fit torch.int32"):
        build_metadata(M.DECODE, kv_lens=[7, 2**31], q_lens=[1, 1], page_table=[[1], [2]], out_cache_loc=[6, 9], page_size=2**31)


def test_a_slot_written_twice_is_rejected_but_the_padding_page_may_repeat() -> None:
    common = dict(kv_lens=[3, 3], q_lens=[1, 1], page_table=[[1], [2]], page_size=4)
    with pytest.raises(SpecError, match="writes slot 6 more than once"):
        build_metadata(ForwardMode.DECODE, out_cache_loc=[6, 6], **common)
    md = build_metadata(ForwardMode.DECODE, out_cache_loc=[0, 0], **common)  # two padded rows
    assert md.out_cache_loc.tolist() == [0, 0]
    assert build_metadata(ForwardMode.DECODE, out_cache_loc=[6, 10], **common).out_cache_loc.tolist() == [6, 10]


@pytest.mark.parametrize("tokens", [8, 5000], ids=["a step (set)", "a long prefill (torch.unique)"])
def test_slot_written_twice_is_found_however_many_tokens(tokens: int) -> None:
    pages = -(-tokens // 4) + 1
    loc = list(range(4, 4 + tokens))
    common = dict(kv_lens=[tokens], q_lens=[tokens], page_table=[list(range(1, pages + 1))], page_size=4)
    assert build_metadata(ForwardMode.EXTEND, out_cache_loc=loc, **common).num_tokens == tokens
    with pytest.raises(SpecError, match=f"writes slot {loc[3]} more than once"):
        build_metadata(ForwardMode.EXTEND, out_cache_loc=loc[:-1] + [loc[3]], **common)
    padded = [0] * 3 + loc[3:]  # the padding page's slot 0, three times
    assert build_metadata(ForwardMode.EXTEND, out_cache_loc=padded, **common).out_cache_loc.tolist()[:3] == [0, 0, 0]


def test_metadata_constructor_checks_tensor_shapes() -> None:
    good = _md().tensors()
    for name, bad in [
        ("kv_lens", torch.zeros(3, dtype=torch.int32)),
        ("cu_q_lens", torch.zeros(2, dtype=torch.int32)),
        ("positions", torch.zeros(4, dtype=torch.int64)),
        ("block_table", torch.zeros(2, dtype=torch.int32)),
        ("block_table", torch.zeros(2, 1, dtype=torch.int32)),  # 4 tokens of capacity < kv_len 5
    ]:
        fields = dict(good, **{name: bad})
        with pytest.raises(SpecError, match=f"AttentionMetadata.{name}"):
            AttentionMetadata(mode=M.EXTEND, page_size=4, kv_lens_cpu=(5, 3), q_lens_cpu=(2, 3), **fields)


@CHEAP
@given(batch=batches(modes=tuple(UNIFORM_MODES)), data=st.data())
def test_pad_metadata_properties(batch, data) -> None:
    mode, ps, kv, q, rows, _ = batch
    q_len = q[0] if q else 1
    md = build_metadata(mode, kv_lens=kv, q_lens=q, page_table=rows, out_cache_loc=slots_for(kv, q, rows, ps), page_size=ps)
    b, width = md.batch_size, md.block_table.shape[1]
    bs = data.draw(st.integers(b, b + 5))
    fill = data.draw(st.integers(1, 3))
    pad_kv = fill + q_len - 1
    # The table must hold the padded requests' kv_len too (all page 0); narrower is an error.
    min_pages = max(width, -(-pad_kv // ps)) if bs > b else width
    max_pages = data.draw(st.integers(min_pages, min_pages + 3))
    padded = pad_metadata(md, bs, fill=fill, max_pages=max_pages)

    assert padded.mode is mode and padded.page_size == ps
    assert padded.kv_lens_cpu == tuple(kv) + (pad_kv,) * (bs - b)
    assert padded.q_lens_cpu == tuple(q) + (q_len,) * (bs - b)
    assert padded.kv_lens.tolist() == list(padded.kv_lens_cpu)
    assert padded.q_lens.tolist() == list(padded.q_lens_cpu)
    cu = [0]
    for ql in padded.q_lens_cpu:
        cu.append(cu[-1] + ql)
    assert padded.cu_q_lens.tolist() == cu
    # Positions follow the one convention (kv_len - q_len + i), padded requests included.
    expect_pos = [n - ql + i for n, ql in zip(padded.kv_lens_cpu, padded.q_lens_cpu) for i in range(ql)]
    assert padded.positions.tolist() == expect_pos
    assert padded.positions[: md.num_tokens].tolist() == md.positions.tolist()
    # Padded tokens write the padding slot and read the padding page only.
    assert padded.out_cache_loc.tolist() == md.out_cache_loc.tolist() + [0] * ((bs - b) * q_len)
    table = md.block_table.tolist() if b else []
    assert padded.block_table.tolist() == [r + [0] * (max_pages - width) for r in table] + [[0] * max_pages] * (bs - b)
    for name, t in md.tensors().items():
        assert padded.tensors()[name].dtype == t.dtype, name
    # Padding twice in steps equals padding once.
    mid = data.draw(st.integers(b, bs))
    twice = pad_metadata(pad_metadata(md, mid, fill=fill, max_pages=max_pages), bs, fill=fill, max_pages=max_pages)
    for name, t in padded.tensors().items():
        assert torch.equal(twice.tensors()[name], t), name
    assert twice.kv_lens_cpu == padded.kv_lens_cpu


def test_pad_metadata_translates_swa_table_with_zero_rows() -> None:
    spec = KVPoolSpec(2, 16, 4, 1, 2, 2, swa=SWAPoolSpec((1,), 8, 1, 2, 2))
    pool = SplitKVPool(spec)
    pool.map_swa_pages(torch.tensor([3, 1]), torch.tensor([1, 2]))
    md = build_metadata(M.DECODE, kv_lens=[5], q_lens=[1], page_table=[[3, 1]], out_cache_loc=[4], pool=pool)
    padded = pad_metadata(md, 3, fill=1, max_pages=3)
    assert padded.swa_block_table is not None
    assert padded.swa_block_table.tolist() == [[1, 2, 0], [0, 0, 0], [0, 0, 0]]


def test_pad_metadata_of_an_empty_batch_uses_the_given_q_len() -> None:
    md = build_metadata(M.TARGET_VERIFY, kv_lens=[], q_lens=[], page_table=[], out_cache_loc=[], page_size=4)
    padded = pad_metadata(md, 2, fill=1, max_pages=2, q_len=3)
    assert padded.q_lens_cpu == (3, 3) and padded.kv_lens_cpu == (3, 3)
    assert padded.positions.tolist() == [0, 1, 2, 0, 1, 2]
    assert pad_metadata(md, 2, fill=1, max_pages=2).q_lens_cpu == (1, 1)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda md: pad_metadata(md, 1, fill=1, max_pages=2), r"batch_size=1 is below the real batch of 2"),
        (lambda md: pad_metadata(md, 4, fill=1, max_pages=1), r"block table has 2 pages, more than max_pages=1"),
        (lambda md: pad_metadata(md, 4, fill=0, max_pages=2), r"fill must be an int >= 1, got 0"),
        (lambda md: pad_metadata(md, 4, fill=True, max_pages=2), r"fill must be an int >= 1, got True"),
        (lambda md: pad_metadata(md, 4, fill=1, max_pages=2, q_len=2), r"q_len=2 but the batch has q_len 1"),
    ],
)
def test_pad_metadata_errors(call, fragment: str) -> None:
    md = _md(mode=M.DECODE, kv=(5, 3), q=(1, 1), out_cache_loc=[0, 1])
    with pytest.raises(SpecError, match=fragment):
        call(md)


def test_pad_metadata_needs_room_for_the_padded_kv_len() -> None:
    md = _md(mode=M.TARGET_VERIFY, kv=(4,), q=(4,), rows=((1,),), out_cache_loc=[0, 1, 2, 3])
    with pytest.raises(SpecError, match="too few for kv_len 5"):
        pad_metadata(md, 2, fill=2, max_pages=1)  # padded kv_len 2 + 4 - 1 = 5 > 1 page of 4
    assert pad_metadata(md, 2, fill=2, max_pages=2).kv_lens_cpu == (4, 5)


def test_pad_metadata_rejects_ragged_extend() -> None:
    with pytest.raises(SpecError, match="EXTEND batches have ragged q_lens"):
        pad_metadata(_md(), 4, fill=1, max_pages=4)


def test_hand_built_metadata() -> None:
    # Two requests, page_size 4: r0 has 5 tokens cached after the step with 2 new (positions 3, 4),
    # pages [7, 2]; r1 is a 3-token prefill on page [5].
    md = build_metadata(M.EXTEND, kv_lens=[5, 3], q_lens=[2, 3], page_table=[[7, 2], [5]],
                        out_cache_loc=[31, 8, 20, 21, 22], page_size=4)
    assert md.cu_q_lens.tolist() == [0, 2, 5]
    assert md.cu_q_lens_cpu == (2, 5)
    assert md.positions.tolist() == [3, 4, 0, 1, 2]
    assert md.block_table.tolist() == [[7, 2], [5, 0]]


def test_one_packed_upload_round_trips_every_tensor_bit_for_bit() -> None:
    """build_metadata sends its int32 and int64 tensors to a device as one buffer; unpacking gives
    back every tensor's values, shape and dtype, the int64 ones at 8-byte aligned offsets."""
    from hal.metadata import pack_ints, unpack_ints

    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(-(2**40), 2**40, (5,), generator=gen),  # int64 beyond int32's range
        torch.randint(-(2**31), 2**31 - 1, (3,), generator=gen, dtype=torch.int32),
        torch.randint(0, 100, (2, 3), generator=gen, dtype=torch.int32),
        torch.randint(-(2**62), 2**62, (1,), generator=gen),
        torch.zeros(0, dtype=torch.int32),
    ]
    packed = pack_ints(tensors)
    assert packed.dtype == torch.int32 and packed.numel() == 5 * 2 + 3 + 6 + 2
    received = packed.clone()
    back = unpack_ints(received, tensors)
    for original, unpacked in zip(tensors, back):
        assert unpacked.dtype == original.dtype and unpacked.shape == original.shape
        assert torch.equal(unpacked, original)
        assert unpacked.numel() == 0 or unpacked.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
        if unpacked.dtype == torch.int64:
            assert (unpacked.data_ptr() - received.data_ptr()) % 8 == 0
    with pytest.raises(SpecError, match="int32/int64"):
        pack_ints([torch.zeros(2)])


@pytest.mark.parametrize("field", ["tree_mask", "out_cache_loc", "page_table", "kv_lens", "q_lens"])
def test_a_meta_device_tensor_is_refused_by_name(field: str) -> None:
    """A tensor on the meta device has a shape and no values: a SpecError naming the argument, not
    torch's NotImplementedError from inside a copy."""
    from hal.errors import SpecError

    args: dict = dict(kv_lens=[4], q_lens=[2], page_table=[[1]], out_cache_loc=[2, 3], page_size=16,
                      tree_mask=torch.ones(2, 2, dtype=torch.bool).tril()[None])
    host = {"tree_mask": args["tree_mask"], "out_cache_loc": torch.tensor([2, 3]), "page_table": torch.tensor([[1]]),
            "kv_lens": torch.tensor([4]), "q_lens": torch.tensor([2])}[field]
    args[field] = host.to("meta")
    with pytest.raises(SpecError, match=rf"{field} is a tensor on the meta device"):
        build_metadata(ForwardMode.TARGET_VERIFY, **args)
    args[field] = host
    assert build_metadata(ForwardMode.TARGET_VERIFY, **args).kv_lens_cpu == (4,)
