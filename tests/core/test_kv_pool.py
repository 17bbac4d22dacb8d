"""Properties of the split-K/V paged pool, for SplitKVPool itself and the backends built on it.

The oracle is the layout contract written out here: layer ``l``'s K is a
``[pages + 1, page_size, heads, dim]`` tensor and full-pool slot ``loc`` of an SWA layer lives at
``(mapping[loc // page_size], loc % page_size)`` of the SWA sub-pool.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hal.backends.cpu import CpuBackend
from hal.allocator import KVAllocator
from hal.errors import CacheLocationError, KVLayoutError
from hal.kv_pool import SplitKVPool
from hal.spec import KVPoolSpec, SWAPoolSpec

CHEAP = settings.get_profile("hal-cheap")

ELEMENT_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


class IndexPutKVPool(SplitKVPool):
    """A backend-style subclass with its own hooks: NaN-filled storage, writes by index_put_."""

    def _allocate(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=self.spec.dtype, device=self.device)

    def _write_rows(self, buffer: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
        buffer.index_put_((loc,), rows)


POOLS: dict[str, Callable[[KVPoolSpec], SplitKVPool]] = {
    "SplitKVPool": SplitKVPool,
    "cpu-backend": lambda spec: CpuBackend().create_kv_pool(spec),
    "subclass": IndexPutKVPool,
}
pool_kinds = pytest.mark.parametrize("make_pool", list(POOLS.values()), ids=list(POOLS))


@st.composite
def pool_specs(draw: st.DrawFn, swa: bool | None = None) -> KVPoolSpec:
    num_layers = draw(st.integers(1, 4))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    num_pages = draw(st.integers(1, 5))
    dims = st.integers(1, 6)
    swa_spec = None
    if swa if swa is not None else draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, num_layers - 1), min_size=1, unique=True))
        swa_spec = SWAPoolSpec(
            layer_ids=ids,
            size=draw(st.integers(1, num_pages)) * page_size,
            kv_heads=draw(st.integers(1, 3)),
            head_dim=draw(dims),
            v_head_dim=draw(dims),
        )
    return KVPoolSpec(
        num_layers=num_layers,
        size=num_pages * page_size,
        page_size=page_size,
        kv_heads=draw(st.integers(1, 3)),
        head_dim=draw(dims),
        v_head_dim=draw(dims),
        dtype=draw(st.sampled_from(list(ELEMENT_BYTES))),
        swa=swa_spec,
    )


def fill_random(pool: SplitKVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for k, v in pool.sub_pool_buffers().values():
        for buf in (k, v):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))


def snapshot(pool: SplitKVPool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(pool.k_buffer(i).clone(), pool.v_buffer(i).clone()) for i in range(pool.spec.num_layers)]


def assert_unchanged(pool: SplitKVPool, before: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer, (k, v) in enumerate(before):
        assert torch.equal(pool.k_buffer(layer), k), f"layer {layer} K changed"
        assert torch.equal(pool.v_buffer(layer), v), f"layer {layer} V changed"


def draw_swa_mapping(draw: st.DrawFn, spec: KVPoolSpec) -> dict[int, int]:
    """A random injective full page -> SWA page map (what an allocator would set up)."""
    if spec.swa is None:
        return {}
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    full = rng.sample(range(1, spec.num_pages + 1), spec.num_pages)
    swa = rng.sample(range(1, spec.swa_num_pages + 1), spec.swa_num_pages)
    n = draw(st.integers(0, min(len(full), len(swa))))
    return dict(zip(full[:n], swa[:n]))


def apply_mapping(pool: SplitKVPool, mapping: dict[int, int]) -> None:
    if mapping:
        pool.map_swa_pages(torch.tensor(list(mapping)), torch.tensor(list(mapping.values())))


def layer_slot(spec: KVPoolSpec, mapping: dict[int, int], layer: int, loc: int) -> tuple[int, int]:
    """(page, offset) inside the layer's own sub-pool for full-pool slot ``loc``."""
    page, offset = divmod(loc, spec.page_size)
    if spec.is_swa_layer(layer):
        page = mapping.get(page, 0)
    return page, offset


def writable_slots(spec: KVPoolSpec, mapping: dict[int, int], layer: int) -> list[int]:
    pages = range(spec.num_pages + 1)
    if spec.is_swa_layer(layer):
        pages = [0, *sorted(mapping)]
    return [p * spec.page_size + o for p in pages for o in range(spec.page_size)]


def random_rows(n: int, heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, heads, dim, generator=gen) + 3.0).to(dtype)


@st.composite
def pool_writes(draw: st.DrawFn, make_pool: Callable[[KVPoolSpec], SplitKVPool], min_rows: int = 0):
    """A filled pool (with an SWA mapping where hybrid), a layer and a valid set_kv batch for it."""
    spec = draw(pool_specs())
    pool = make_pool(spec)
    seed = draw(st.integers(0, 2**31 - 1))
    fill_random(pool, seed)
    mapping = draw_swa_mapping(draw, spec)
    apply_mapping(pool, mapping)
    layer = draw(st.integers(0, spec.num_layers - 1))
    slots = writable_slots(spec, mapping, layer)
    locs = draw(st.lists(st.sampled_from(slots), min_size=min_rows, max_size=min(len(slots), 12), unique=True))
    loc = torch.tensor(locs, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    heads, dk, dv = spec.layer_dims(layer)
    gen = torch.Generator().manual_seed(seed + 1)
    k = random_rows(len(locs), heads, dk, spec.dtype, gen)
    v = random_rows(len(locs), heads, dv, spec.dtype, gen)
    return pool, mapping, layer, loc, k, v


@pool_kinds
@CHEAP
@given(data=st.data())
def test_set_kv_round_trip_touches_only_the_written_slots(make_pool, data) -> None:
    pool, mapping, layer, loc, k, v = data.draw(pool_writes(make_pool))
    spec = pool.spec
    expected = snapshot(pool)
    for i, slot in enumerate(loc.tolist()):
        page, offset = layer_slot(spec, mapping, layer, slot)
        expected[layer][0][page, offset] = k[i]
        expected[layer][1][page, offset] = v[i]

    pool.set_kv(layer, loc, k, v)

    # Every layer, both K and V: the written slots hold the new rows, nothing else moved.
    assert_unchanged(pool, expected)
    # The sub-pool storage itself (not only the views) holds the result.
    for name, (k_all, v_all) in pool.sub_pool_buffers().items():
        ids = spec.swa.layer_ids if name == "swa" and spec.swa else spec.full_layer_ids
        assert torch.equal(k_all, torch.stack([expected[i][0] for i in ids]))
        assert torch.equal(v_all, torch.stack([expected[i][1] for i in ids]))


BAD_WRITES = [
    "loc_above_range",
    "loc_negative",
    "loc_float",
    "loc_int16",
    "loc_2d",
    "loc_list",
    "loc_meta",
    "k_dtype",
    "v_dtype",
    "k_head_dim",
    "v_head_dim",
    "k_heads",
    "v_rows",
    "k_2d",
    "k_meta",
    "v_meta",
    "k_not_tensor",
    "layer_above",
    "layer_negative",
    "layer_bool",
    "swa_unmapped_page",
]


def corrupt(kind: str, pool: SplitKVPool, mapping: dict[int, int], layer: int, loc, k, v, draw):
    """Turn a valid write into a bad one; returns (args, error type, message fragment)."""
    spec = pool.spec
    limit = (spec.num_pages + 1) * spec.page_size
    if kind in ("loc_above_range", "loc_negative"):
        bad = limit + draw(st.integers(0, 3)) if kind == "loc_above_range" else -1 - draw(st.integers(0, 3))
        loc = loc.clone()
        loc[draw(st.integers(0, len(loc) - 1))] = bad
        return (layer, loc, k, v), CacheLocationError, f"cache location {bad} out of range"
    if kind == "swa_unmapped_page":
        swa_layers = spec.swa.layer_ids if spec.swa else ()
        unmapped = [p for p in range(1, spec.num_pages + 1) if p not in mapping]
        if not swa_layers or not unmapped:
            return None
        layer = draw(st.sampled_from(swa_layers))
        heads, dk, dv = spec.layer_dims(layer)
        page = draw(st.sampled_from(unmapped))
        slot = page * spec.page_size + draw(st.integers(0, spec.page_size - 1))
        mapped = [p * spec.page_size for p in [0, *mapping]]
        loc = torch.tensor([*mapped, slot])
        gen = torch.Generator().manual_seed(7)
        k, v = (random_rows(len(loc), heads, d, spec.dtype, gen) for d in (dk, dv))
        return (layer, loc, k, v), CacheLocationError, f"full page {page}, which has no SWA page mapped"
    other = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float16, torch.float16: torch.float32}
    n, heads = k.shape[0], k.shape[1]
    table = {
        "loc_float": ((layer, loc.float(), k, v), "loc must be a 1-D int32/int64"),
        "loc_int16": ((layer, loc.to(torch.int16), k, v), "loc must be a 1-D int32/int64"),
        "loc_2d": ((layer, loc.view(-1, 1), k, v), "loc must be a 1-D int32/int64"),
        "loc_list": ((layer, loc.tolist(), k, v), "loc must be a 1-D int32/int64"),
        "loc_meta": ((layer, loc.to("meta"), k, v), "loc is on meta"),
        "k_dtype": ((layer, loc, k.to(other[spec.dtype]), v), f"k has dtype {other[spec.dtype]}"),
        "v_dtype": ((layer, loc, k, v.to(torch.float64)), "v has dtype torch.float64"),
        "k_head_dim": ((layer, loc, torch.zeros(n, heads, k.shape[2] + 1, dtype=spec.dtype), v), "k has shape"),
        "v_head_dim": ((layer, loc, k, torch.zeros(n, heads, v.shape[2] + 1, dtype=spec.dtype)), "v has shape"),
        "k_heads": ((layer, loc, torch.zeros(n, heads + 1, k.shape[2], dtype=spec.dtype), v), "k has shape"),
        "v_rows": ((layer, loc, k, torch.zeros(n + 1, heads, v.shape[2], dtype=spec.dtype)), "v has shape"),
        "k_2d": ((layer, loc, k.reshape(n, -1), v), "k has shape"),
        "k_meta": ((layer, loc, k.to("meta"), v), "k is on meta"),
        "v_meta": ((layer, loc, k, v.to("meta")), "v is on meta"),
        "k_not_tensor": ((layer, loc, k.tolist(), v), "k must be a tensor"),
        "layer_above": ((spec.num_layers, loc, k, v), f"layer must be an int in 0..{spec.num_layers - 1}, got {spec.num_layers}"),
        "layer_negative": ((-1, loc, k, v), f"layer must be an int in 0..{spec.num_layers - 1}, got -1"),
        "layer_bool": ((True, loc, k, v), f"layer must be an int in 0..{spec.num_layers - 1}, got True"),
    }
    args, fragment = table[kind]
    return args, KVLayoutError, fragment


@pool_kinds
@CHEAP
@given(data=st.data(), kind=st.sampled_from(BAD_WRITES))
def test_bad_set_kv_raises_typed_error_and_writes_nothing(make_pool, data, kind: str) -> None:
    pool, mapping, layer, loc, k, v = data.draw(pool_writes(make_pool, min_rows=1))
    bad = corrupt(kind, pool, mapping, layer, loc, k, v, data.draw)
    if bad is None:  # this pool has no unmapped SWA page to aim at; the valid write must succeed
        pool.set_kv(layer, loc, k, v)
        return
    args, error, fragment = bad
    before = snapshot(pool)
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        pool.set_kv(*args)
    assert_unchanged(pool, before)


@pool_kinds
def test_empty_write_is_a_no_op(make_pool) -> None:
    spec = KVPoolSpec(2, 8, 4, 2, 3, 5, swa=SWAPoolSpec((1,), 4, 1, 2, 2))
    pool = make_pool(spec)
    fill_random(pool, 0)
    before = snapshot(pool)
    for layer in range(2):
        heads, dk, dv = spec.layer_dims(layer)
        pool.set_kv(layer, torch.zeros(0, dtype=torch.int64), torch.zeros(0, heads, dk), torch.zeros(0, heads, dv))
    assert_unchanged(pool, before)


@CHEAP
@given(spec=pool_specs())
def test_bytes_per_token_matches_hand_formula(spec: KVPoolSpec) -> None:
    e = ELEMENT_BYTES[spec.dtype]
    swa_layers = len(spec.swa.layer_ids) if spec.swa else 0
    expected = (spec.num_layers - swa_layers) * spec.kv_heads * (spec.head_dim + spec.v_head_dim) * e
    if spec.swa:
        expected += swa_layers * spec.swa.kv_heads * (spec.swa.head_dim + spec.swa.v_head_dim) * e
    for make_pool in POOLS.values():
        assert make_pool(spec).bytes_per_token() == expected


def test_bytes_per_token_mimo_like_hand_value() -> None:
    # 2 full layers (4 kv heads, 192/128) + 1 SWA layer (8 kv heads, 192/128), bf16:
    # 2 * 4 * 320 * 2 + 1 * 8 * 320 * 2 = 5120 + 5120.
    spec = KVPoolSpec(3, 64, 16, 4, 192, 128, torch.bfloat16, SWAPoolSpec((2,), 32, 8, 192, 128))
    assert SplitKVPool(spec).bytes_per_token() == 10240


@pool_kinds
@CHEAP
@given(spec=pool_specs())
def test_buffer_shapes_dtype_and_slot_counts(make_pool, spec: KVPoolSpec) -> None:
    pool = make_pool(spec)
    ps = spec.page_size
    for layer in range(spec.num_layers):
        if spec.swa is not None and layer in spec.swa.layer_ids:
            pages, heads, dk, dv = spec.swa.size // ps, spec.swa.kv_heads, spec.swa.head_dim, spec.swa.v_head_dim
        else:
            pages, heads, dk, dv = spec.size // ps, spec.kv_heads, spec.head_dim, spec.v_head_dim
        k, v = pool.k_buffer(layer), pool.v_buffer(layer)
        assert tuple(k.shape) == (pages + 1, ps, heads, dk)
        assert tuple(v.shape) == (pages + 1, ps, heads, dv)
        assert k.dtype == v.dtype == spec.dtype
        assert k.device == v.device == pool.device
        assert pool.num_slots(layer) == (pages + 1) * ps
        assert pool.is_swa_layer(layer) == (spec.swa is not None and layer in spec.swa.layer_ids)
    assert len(pool.k_buffers) == len(pool.v_buffers) == spec.num_layers
    assert (pool.full_to_swa_page is None) == (spec.swa is None)


@pool_kinds
@CHEAP
@given(spec=pool_specs())
def test_layer_views_alias_sub_pool_storage(make_pool, spec: KVPoolSpec) -> None:
    pool = make_pool(spec)
    subs = pool.sub_pool_buffers()
    swa_ids = list(spec.swa.layer_ids) if spec.swa else []
    full_ids = [i for i in range(spec.num_layers) if i not in swa_ids]
    assert set(subs) == ({"full"} if full_ids else set()) | ({"swa"} if swa_ids else set())
    seen = []
    for layer in range(spec.num_layers):
        name, index = ("swa", swa_ids.index(layer)) if layer in swa_ids else ("full", full_ids.index(layer))
        for view, listed, whole in (
            (pool.k_buffer(layer), pool.k_buffers[layer], subs[name][0]),
            (pool.v_buffer(layer), pool.v_buffers[layer], subs[name][1]),
        ):
            assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            assert view.data_ptr() == whole[index].data_ptr() == listed.data_ptr()
            seen.append((view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()))
            # A write through the sub-pool tensor shows in the view: no copy in between.
            whole[index].view(-1)[-1] = 42.0
            assert float(view.reshape(-1)[-1]) == 42.0
    seen.sort()
    assert all(end <= start for (_, end), (start, _) in zip(seen, seen[1:])), "layer/KV views overlap"


@CHEAP
@given(data=st.data())
def test_swa_block_table_and_translate_loc_follow_the_mapping(data) -> None:
    spec = data.draw(pool_specs(swa=True))
    pool = SplitKVPool(spec)
    mapping = draw_swa_mapping(data.draw, spec)
    apply_mapping(pool, mapping)
    rows = data.draw(st.integers(1, 4))
    cols = data.draw(st.integers(1, 4))
    entries = data.draw(st.lists(st.integers(0, spec.num_pages), min_size=rows * cols, max_size=rows * cols))
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    table = torch.tensor(entries, dtype=dtype).view(rows, cols)
    got = pool.swa_block_table(table)
    assert got.dtype == dtype
    assert got.tolist() == [[mapping.get(p, 0) for p in entries[r * cols : (r + 1) * cols]] for r in range(rows)]

    locs = data.draw(st.lists(st.integers(0, (spec.num_pages + 1) * spec.page_size - 1), max_size=10))
    for layer in range(spec.num_layers):
        out = pool.translate_loc(layer, torch.tensor(locs, dtype=torch.int64)).tolist()
        if spec.is_swa_layer(layer):
            expect = [mapping.get(x // spec.page_size, 0) * spec.page_size + x % spec.page_size for x in locs]
        else:
            expect = locs
        assert out == expect


@CHEAP
@given(data=st.data())
def test_allocator_keeps_swa_mapping_consistent(data) -> None:
    """Every live full page maps to a distinct live SWA page; freed pages are unmapped and unwritable."""
    spec = data.draw(pool_specs(swa=True))
    pool = SplitKVPool(spec)
    alloc = KVAllocator(pool)
    assert alloc.swa is not None
    live: list[list[int]] = []
    swa_layer = spec.swa.layer_ids[0]
    heads, dk, dv = spec.layer_dims(swa_layer)
    freed: set[int] = set()
    for _ in range(data.draw(st.integers(1, 8))):
        if live and data.draw(st.booleans()):
            pages = live.pop(data.draw(st.integers(0, len(live) - 1)))
            alloc.free(pages)
            freed.update(pages)
        else:
            n = data.draw(st.integers(0, alloc.num_free_pages))
            pages = alloc.alloc(n)
            live.append(pages)
            freed.difference_update(pages)
        mapping = pool.full_to_swa_page.tolist()
        live_pages = [p for group in live for p in group]
        assert mapping[0] == 0
        swa_of_live = [mapping[p] for p in live_pages]
        assert all(1 <= s <= spec.swa_num_pages for s in swa_of_live)
        assert len(set(swa_of_live)) == len(swa_of_live)
        assert all(mapping[p] == 0 for p in range(1, spec.num_pages + 1) if p not in live_pages)
        assert alloc.full.num_free == spec.num_pages - len(live_pages)
        assert alloc.swa.num_free == spec.swa_num_pages - len(live_pages)
        for page in sorted(freed)[:1]:
            with pytest.raises(CacheLocationError, match="no SWA page mapped"):
                pool.set_kv(swa_layer, torch.tensor([page * spec.page_size]), torch.zeros(1, heads, dk, dtype=spec.dtype),
                            torch.zeros(1, heads, dv, dtype=spec.dtype))


def test_map_swa_pages_rejects_bad_input_and_keeps_the_mapping() -> None:
    spec = KVPoolSpec(2, 16, 4, 1, 2, 2, swa=SWAPoolSpec((1,), 8, 1, 2, 2))  # 4 full pages, 2 SWA pages
    pool = SplitKVPool(spec)
    pool.map_swa_pages(torch.tensor([3]), torch.tensor([2]))
    before = pool.full_to_swa_page.clone()
    cases = [
        (lambda: pool.map_swa_pages(torch.tensor([1, 2]), torch.tensor([1])), KVLayoutError, "2 full pages but 1 SWA"),
        (lambda: pool.map_swa_pages(torch.tensor([0]), torch.tensor([1])), CacheLocationError, r"full pages must lie in 1\.\.4"),
        (lambda: pool.map_swa_pages(torch.tensor([5]), torch.tensor([1])), CacheLocationError, r"full pages must lie in 1\.\.4"),
        (lambda: pool.map_swa_pages(torch.tensor([1]), torch.tensor([3])), CacheLocationError, r"SWA pages must lie in 1\.\.2"),
        (lambda: pool.map_swa_pages(torch.tensor([1]), torch.tensor([0])), CacheLocationError, r"SWA pages must lie in 1\.\.2"),
        (lambda: pool.unmap_swa_pages(torch.tensor([5])), CacheLocationError, r"full pages must lie in 0\.\.4"),
        (lambda: pool.unmap_swa_pages(torch.tensor([-1])), CacheLocationError, r"full pages must lie in 0\.\.4"),
    ]
    for call, error, fragment in cases:
        with pytest.raises(error, match=fragment):
            call()
        assert torch.equal(pool.full_to_swa_page, before)
    pool.unmap_swa_pages(torch.tensor([3]))
    assert pool.full_to_swa_page.tolist() == [0, 0, 0, 0, 0]


def test_swa_calls_on_a_pool_without_swa_raise() -> None:
    pool = SplitKVPool(KVPoolSpec(1, 8, 4, 1, 2, 2))
    for call in (
        lambda: pool.map_swa_pages(torch.tensor([1]), torch.tensor([1])),
        lambda: pool.unmap_swa_pages(torch.tensor([1])),
        lambda: pool.swa_block_table(torch.zeros(1, 1, dtype=torch.int32)),
    ):
        with pytest.raises(KVLayoutError, match="no SWA part"):
            call()


def test_bad_layer_on_buffer_accessors_raises() -> None:
    pool = SplitKVPool(KVPoolSpec(2, 8, 4, 1, 2, 2))
    for call in (pool.k_buffer, pool.v_buffer, pool.is_swa_layer, pool.num_slots):
        with pytest.raises(KVLayoutError, match=r"layer must be an int in 0\.\.1, got 2"):
            call(2)


def test_hand_computed_swa_write_lands_at_mapped_slot() -> None:
    # page_size 4; full page 3 is backed by SWA page 2: full slot 13 = (page 3, offset 1) -> SWA (2, 1).
    spec = KVPoolSpec(2, 16, 4, 1, 2, 3, swa=SWAPoolSpec((1,), 8, 1, 2, 3))
    pool = SplitKVPool(spec)
    pool.map_swa_pages(torch.tensor([3]), torch.tensor([2]))
    pool.set_kv(1, torch.tensor([13]), torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[3.0, 4.0, 5.0]]]))
    k, v = pool.k_buffer(1), pool.v_buffer(1)
    assert k[2, 1, 0].tolist() == [1.0, 2.0] and v[2, 1, 0].tolist() == [3.0, 4.0, 5.0]
    assert int((k != 0).sum()) == 2 and int((v != 0).sum()) == 3
    assert int((pool.k_buffer(0) != 0).sum()) == 0  # the full layer saw nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, dim", [(4, 8), (2, 3), (1, 1)])  # rows of 16k bytes, odd widths, one element
@pytest.mark.parametrize("strided", [False, True])
def test_set_kv_copies_every_bit_pattern_exactly(dtype, heads, dim, strided) -> None:
    """Whatever element width the write uses, NaN payloads, infinities and -0.0 land bit for bit,
    for contiguous rows and for rows that are slices of a wider tensor (a fused qkv output)."""
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(bits)
    pool = SplitKVPool(KVPoolSpec(2, 16, 4, heads, dim, dim, dtype))
    gen = torch.Generator().manual_seed(heads * dim)
    n = 7

    def rows() -> torch.Tensor:
        raw = torch.randint(info.min, info.max, (n, heads, 2 * dim if strided else dim), generator=gen, dtype=torch.int64)
        x = raw.to(bits).view(dtype)
        return x[..., 1 : dim + 1] if strided else x

    k, v = rows(), rows()
    loc = torch.tensor([5, 19, 4, 12, 17, 6, 8])
    before_other = pool.k_buffer(0).clone()
    pool.set_kv(1, loc, k, v)
    kb, vb = pool.k_buffer(1).reshape(-1, heads, dim), pool.v_buffer(1).reshape(-1, heads, dim)
    assert torch.equal(kb[loc].view(bits), k.contiguous().view(bits))
    assert torch.equal(vb[loc].view(bits), v.contiguous().view(bits))
    untouched = torch.ones(kb.shape[0], dtype=torch.bool)
    untouched[loc] = False
    assert not kb[untouched].view(bits).any() and not vb[untouched].view(bits).any()
    assert torch.equal(pool.k_buffer(0).view(bits), before_other.view(bits))


# -- engine-owned storage ---------------------------------------------------------------------


def _engine_storage(spec: KVPoolSpec) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One flat engine allocation, every layer's K then V carved out of it in order."""
    shapes = spec.buffer_shapes()
    where = {layer: "full" for layer in spec.full_layer_ids} | {layer: "swa" for layer in (spec.swa.layer_ids if spec.swa else ())}
    per_layer = [tuple(s[1:] for s in shapes[where[layer]]) for layer in range(spec.num_layers)]
    total = sum(int(torch.Size(k).numel() + torch.Size(v).numel()) for k, v in per_layer)
    raw = torch.full((total,), float("nan"), dtype=spec.dtype)
    storage, at = [], 0
    for k_shape, v_shape in per_layer:
        pair = []
        for shape in (k_shape, v_shape):
            n = int(torch.Size(shape).numel())
            pair.append(raw[at : at + n].view(shape))
            at += n
        storage.append((pair[0], pair[1]))
    return raw, storage


@CHEAP
@given(data=st.data())
def test_pool_over_engine_storage_writes_into_the_engines_memory(data) -> None:
    """A pool made over an engine's tensors is their view: set_kv lands in the engine's memory,
    at the slot the layout contract says, and the pool allocates nothing of its own."""
    spec = data.draw(pool_specs().filter(lambda s: len(s.full_layer_ids) > 0))
    raw, storage = _engine_storage(spec)
    pool = CpuBackend().create_kv_pool(spec, storage=storage)
    layer = data.draw(st.sampled_from(spec.full_layer_ids))  # full layers: slots need no SWA mapping
    slots = pool.num_slots(layer)
    loc = torch.tensor(data.draw(st.lists(st.integers(spec.page_size, slots - 1), min_size=1, max_size=4, unique=True)))
    k_dim, v_dim = storage[layer][0].shape[3], storage[layer][1].shape[3]
    heads = storage[layer][0].shape[2]
    k = torch.randn(len(loc), heads, k_dim).to(spec.dtype)
    v = torch.randn(len(loc), heads, v_dim).to(spec.dtype)
    pool.set_kv(layer, loc, k, v)
    page, offset = loc // spec.page_size, loc % spec.page_size
    assert torch.equal(storage[layer][0][page, offset], k) and torch.equal(storage[layer][1][page, offset], v)
    assert pool.k_buffer(layer).data_ptr() == storage[layer][0].data_ptr()
    assert int((~raw.isnan()).sum()) == k.numel() + v.numel()  # nothing else in the engine's memory changed
    with pytest.raises(KVLayoutError, match="engine-owned"):
        pool.sub_pool_buffers()


@pytest.mark.parametrize("bad", ["count", "shape", "dtype", "strided", "overlap"])
def test_pool_over_bad_engine_storage_is_refused_by_name(bad: str) -> None:
    spec = KVPoolSpec(num_layers=2, size=8, page_size=4, kv_heads=2, head_dim=8, v_head_dim=4, dtype=torch.float32)
    _, storage = _engine_storage(spec)
    expected = {"count": "one \\(K, V\\) pair per layer", "shape": "layer 1 K is", "dtype": "layer 0 V is",
                "strided": "layer 1 V has strides", "overlap": "overlap"}[bad]
    if bad == "count":
        storage = storage[:1]
    elif bad == "shape":
        storage[1] = (storage[1][0][:2], storage[1][1])
    elif bad == "dtype":
        storage[0] = (storage[0][0], storage[0][1].half())
    elif bad == "strided":
        wide = torch.zeros(3, 4, 2, 8)
        storage[1] = (storage[1][0], wide[..., ::2])
    else:
        storage[1] = (storage[0][0], storage[1][1])
    with pytest.raises(KVLayoutError, match=expected):
        CpuBackend().create_kv_pool(spec, storage=storage)
