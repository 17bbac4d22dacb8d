"""The CPU backend's pure-torch kernel (tiles, gathers, in-place strided reads, torch's flash kernel)
against hal's oracle (``hal.oracle.dense_attention``, float64), over pools whose unwritten rows hold
NaN and inf. Every batch here goes through it (``torch_kernel``); the compiled kernel, which takes
decode-sized batches by default, is held to the same oracle in ``test_native_kernel.py``."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hal.backends.cpu.paged_attention as cpu_kernel
import hal.backends.cpu.tile_plan as tile_plan
from hal.backends.cpu import CpuBackend
from hal.backends.cpu.paged_attention import paged_attention
from hal.oracle import dense_attention
from hal.metadata import build_metadata
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec
from hal.tools.conformance import tree_cases
from hal.tools.testing import TOLERANCE, run_attention_case
from hal.tree import tree_mask_from_parents

pytestmark = pytest.mark.usefixtures("torch_kernel")

M = ForwardMode
EXPENSIVE = settings.get_profile("hal-expensive")


def dense_oracle(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], q_lens: list[int], layer: LayerSpec,
    sinks: torch.Tensor | None, trees: torch.Tensor | None = None,
) -> torch.Tensor:
    return dense_attention(q, keys, values, q_lens, scaling=layer.scaling, sliding_window=layer.sliding_window, sinks=sinks,
                           trees=None if trees is None else list(trees))


def run_cpu_kernel(
    mode: ForwardMode,
    layer: LayerSpec,
    kv_lens: list[int],
    q_lens: list[int],
    *,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
    hybrid: bool = False,
    save_kv_cache: bool = True,
    contiguous: bool = False,
    reserved_pages: int | None = None,
    tree_parents: list[list[int]] | None = None,
):
    """Run CpuAttention on a NaN/inf-filled pool holding per-request dense K/V; return (out, oracle).
    Pages are handed out in a shuffled order, or in order (``contiguous``: each request's pages,
    and on a hybrid pool their SWA pages, consecutive; ``reserved_pages``: each request's run
    starts that many pages after the previous one's, as an engine reserving equal needs lays them)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    ps = page_size
    reserved = [reserved_pages or -(-n // ps) for n in kv_lens]
    num_pages = sum(reserved) + 2
    heads, dk, dv = layer.num_kv_heads, layer.head_dim, layer.v_head_dim
    num_layers = layer.layer_id + 2
    if hybrid:
        swa = SWAPoolSpec((layer.layer_id,), (num_pages + 1) * ps, heads, dk, dv)
        spec = KVPoolSpec(num_layers, num_pages * ps, ps, heads + 1, dk + 1, dv + 1, dtype, swa)
    else:
        spec = KVPoolSpec(num_layers, num_pages * ps, ps, heads, dk, dv, dtype)
    backend = CpuBackend()
    pool = backend.create_kv_pool(spec)
    # NaN keys and inf values everywhere no token is written (what a reused page may hold): a stray
    # read shows, and so does a masked one, since a weight of 0 times NaN or inf is NaN.
    for k_all, v_all in pool.sub_pool_buffers().values():
        k_all.fill_(float("nan"))
        v_all.fill_(float("inf"))
    order = list(range(1, num_pages + 1))
    if not contiguous:
        rng.shuffle(order)
    rows, at = [], 0
    for n, taken in zip(kv_lens, reserved):
        rows.append(order[at : at + -(-n // ps)])
        at += taken
    if hybrid:
        swa_pages = list(range(1, num_pages + 1)) if contiguous else rng.sample(range(1, spec.swa_num_pages + 1), num_pages)
        pool.map_swa_pages(torch.tensor(order), torch.tensor(swa_pages))

    def slots(b: int, start: int, stop: int) -> list[int]:
        return [rows[b][p // ps] * ps + p % ps for p in range(start, stop)]

    keys = [torch.randn(n, heads, dk, generator=gen).to(dtype) for n in kv_lens]
    values = [torch.randn(n, heads, dv, generator=gen).to(dtype) for n in kv_lens]
    for b, (n, ql) in enumerate(zip(kv_lens, q_lens)):
        stop = n if not save_kv_cache else n - ql  # without save_kv_cache the caller stored the new rows
        if stop:
            pool.set_kv(layer.layer_id, torch.tensor(slots(b, 0, stop)), keys[b][:stop], values[b][:stop])
    new_loc = [s for b, (n, ql) in enumerate(zip(kv_lens, q_lens)) for s in slots(b, n - ql, n)]
    k_new = torch.cat([keys[b][n - ql :] for b, (n, ql) in enumerate(zip(kv_lens, q_lens))])
    v_new = torch.cat([values[b][n - ql :] for b, (n, ql) in enumerate(zip(kv_lens, q_lens))])
    q = torch.randn(sum(q_lens), layer.num_q_heads, dk, generator=gen).to(dtype)
    sinks = torch.randn(layer.num_q_heads, generator=gen) * 2 if layer.has_sinks else None
    trees = None if tree_parents is None else tree_mask_from_parents(tree_parents)
    md = build_metadata(mode, kv_lens=kv_lens, q_lens=q_lens, page_table=rows, out_cache_loc=new_loc, pool=pool, tree_mask=trees)
    before = [t.clone() for pair in pool.sub_pool_buffers().values() for t in pair]
    attn = backend.create_attention(pool)
    out = attn.forward(q, k_new, v_new, layer, attn.plan(md), save_kv_cache=save_kv_cache, sinks=sinks)
    if save_kv_cache:  # the new rows were stored where out_cache_loc says, on the layer's sub-pool
        kb = pool.k_buffer(layer.layer_id)
        mapping = pool.full_to_swa_page
        for r, loc in enumerate(new_loc):
            page = int(mapping[loc // ps]) if hybrid else loc // ps
            assert torch.equal(kb[page, loc % ps], k_new[r])
    else:
        after = [t for pair in pool.sub_pool_buffers().values() for t in pair]
        same = all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(after, before))
        assert same, "save_kv_cache=False wrote the cache"
    return out, dense_oracle(q, keys, values, q_lens, layer, sinks, trees)


def assert_close(out: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == dtype
    assert out.shape == expect.shape
    torch.testing.assert_close(out.double(), expect, atol=atol, rtol=rtol)


@st.composite
def attention_cases(draw: st.DrawFn):
    mode = draw(st.sampled_from([M.EXTEND, M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND_V2]))
    ps = draw(st.sampled_from([1, 2, 4, 16]))
    b = draw(st.integers(1, 4))
    longest = min(3 * ps + 5, 40)
    if mode is M.EXTEND:
        kv = draw(st.lists(st.integers(1, longest), min_size=b, max_size=b))
        q = [draw(st.integers(0, n)) for n in kv]
    else:
        q_len = 1 if mode is M.DECODE else draw(st.integers(2, 5))
        kv = draw(st.lists(st.integers(q_len, longest + q_len), min_size=b, max_size=b))
        q = [q_len] * b
    window = draw(st.one_of(st.none(), st.integers(0, 6)))
    hkv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    dk, dv = draw(st.sampled_from([4, 8])), draw(st.sampled_from([4, 8, 12]))
    layer = LayerSpec(
        layer_id=draw(st.integers(0, 1)),
        num_q_heads=hkv * group,
        num_kv_heads=hkv,
        head_dim=dk,
        v_head_dim=dv,
        scaling=draw(st.floats(0.05, 1.0)),
        sliding_window=window,
        has_sinks=draw(st.booleans()),
    )
    return dict(
        mode=mode,
        layer=layer,
        kv_lens=kv,
        q_lens=q,
        page_size=ps,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        seed=draw(st.integers(0, 2**31 - 1)),
        hybrid=window is not None and draw(st.booleans()),
        save_kv_cache=draw(st.booleans()),
    )


@EXPENSIVE
@given(case=attention_cases())
def test_cpu_kernel_matches_the_oracle(case) -> None:
    out, expect = run_cpu_kernel(**case)
    assert_close(out, expect, case["dtype"])


@pytest.mark.parametrize("mode", [M.EXTEND, M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND_V2])
@pytest.mark.parametrize("window, sinks, hybrid", [(None, False, False), (None, True, False), (3, False, False), (3, True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_dim", [12, 8])  # qk != v: explicit matmuls; qk == v: torch's flash kernel
def test_every_mode_and_feature_matches_dense_oracle(mode, window, sinks, hybrid, dtype, v_dim) -> None:
    layer = LayerSpec(1, 4, 2, 8, v_dim, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)  # GQA
    q_len = {M.EXTEND: None, M.DECODE: 1, M.TARGET_VERIFY: 4, M.DRAFT_EXTEND_V2: 4}[mode]
    kv = [19, 4, 9]
    q = [7, 4, 9] if q_len is None else [q_len] * 3  # EXTEND: chunk on a prefix, a full prefill, another
    out, expect = run_cpu_kernel(mode, layer, kv, q, page_size=4, dtype=dtype, seed=len(kv) * 7 + int(mode), hybrid=hybrid)
    assert_close(out, expect, dtype)


@pytest.mark.parametrize("mode", [M.EXTEND, M.DECODE, M.TARGET_VERIFY])
@pytest.mark.parametrize("window, sinks, hybrid", [(None, True, False), (3, True, True)])
def test_one_request_per_gather_chunk_matches_dense_oracle(mode, window, sinks, hybrid, monkeypatch) -> None:
    """A chunk budget below one request's K/V attends every request in its own group."""
    monkeypatch.setattr(tile_plan, "GATHER_CHUNK_BYTES", 1)
    layer = LayerSpec(1, 4, 2, 8, 12, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    kv = [19, 4, 0, 9] if mode is M.EXTEND else [19, 4, 9]
    q = [7, 4, 0, 9] if mode is M.EXTEND else [{M.DECODE: 1, M.TARGET_VERIFY: 4}[mode]] * 3
    out, expect = run_cpu_kernel(mode, layer, kv, q, page_size=4, dtype=torch.float32, seed=11, hybrid=hybrid)
    assert_close(out, expect, torch.float32)


@pytest.mark.parametrize("mode", [M.EXTEND, M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND_V2])
@pytest.mark.parametrize("window, sinks, hybrid", [(None, False, False), (None, True, False), (3, False, False), (3, True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consecutive_pages_are_read_in_place_and_match_dense_oracle(mode, window, sinks, hybrid, dtype, monkeypatch) -> None:
    """Requests whose pages are consecutive in the pool are attended over views of the cache (no
    gather), one tile at a time; shuffled pages are gathered. Both equal the dense oracle."""
    monkeypatch.setattr(tile_plan, "VIEW_MIN_TILE_BYTES", 0)
    monkeypatch.setattr(tile_plan, "EXTEND_TILE_ROWS", 3)  # prompt tiles below FUSED_MIN_ROWS
    in_place = []
    original = cpu_kernel._attend_in_place
    monkeypatch.setattr(cpu_kernel, "_attend_in_place", lambda *a: in_place.append(a[3].tiles) or original(*a))
    layer = LayerSpec(1, 4, 2, 8, 12, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    q_len = {M.EXTEND: None, M.DECODE: 1, M.TARGET_VERIFY: 4, M.DRAFT_EXTEND_V2: 4}[mode]
    kv = [19, 4, 9]
    q = [7, 4, 9] if q_len is None else [q_len] * 3
    for contiguous in (True, False):
        in_place.clear()
        out, expect = run_cpu_kernel(mode, layer, kv, q, page_size=4, dtype=dtype, seed=3, hybrid=hybrid, contiguous=contiguous)
        assert_close(out, expect, dtype)
        assert bool(in_place) == contiguous


@pytest.mark.parametrize("mode", [M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND_V2])
@pytest.mark.parametrize("window, sinks, hybrid", [(None, False, False), (None, True, False), (3, True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_bytes", [None, 1])
@pytest.mark.parametrize("v_dim", [4, 12])
def test_equal_requests_on_evenly_spaced_pages_are_one_strided_view(mode, window, sinks, hybrid, dtype, group_bytes, v_dim,
                                                                    monkeypatch) -> None:
    """Requests of equal length whose consecutive pages start evenly spaced (admitted together)
    are attended as one strided view of the cache, in one batch (or one request per group under
    a budget of one byte): through torch's flash kernel where the qk head dim is at least v's (V
    read qk-wide), else the explicit matmuls. Both equal the dense oracle."""
    if group_bytes is not None:
        monkeypatch.setattr(tile_plan, "STRIDED_GROUP_BYTES", group_bytes)
    views, flash = [], []
    view, attention = cpu_kernel._strided_view, cpu_kernel._attention
    monkeypatch.setattr(cpu_kernel, "_strided_view", lambda *a, **k: views.append(a[1].tiles) or view(*a, **k))
    monkeypatch.setattr(cpu_kernel, "_attention",
                        lambda qt, keys, values, *a: flash.append(values.shape[3] == keys.shape[3]) or attention(qt, keys, values, *a))
    layer = LayerSpec(1, 4, 2, 8, v_dim, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    q_len = {M.DECODE: 1, M.TARGET_VERIFY: 4, M.DRAFT_EXTEND_V2: 4}[mode]
    out, expect = run_cpu_kernel(mode, layer, [10, 10, 10], [q_len] * 3, page_size=4, dtype=dtype, seed=9, hybrid=hybrid,
                                contiguous=True)
    assert_close(out, expect, dtype)
    per_group = [3] if group_bytes is None else [1, 1, 1]
    assert views == [t for t in per_group for _ in range(2)]  # K and V of each group, read in place
    assert flash == [v_dim <= 8] * len(per_group)


@pytest.mark.parametrize("mode, q_len, kv", [(M.DECODE, 1, [10, 13, 9]), (M.TARGET_VERIFY, 4, [10, 12, 9]),
                                            (M.DRAFT_EXTEND_V2, 4, [14, 11, 12])])
@pytest.mark.parametrize("window, sinks, hybrid", [(None, True, False), (3, True, True), (None, False, False)])
@pytest.mark.parametrize("v_dim", [4, 12])
def test_unequal_requests_on_evenly_spaced_reservations_are_one_strided_view(mode, q_len, kv, window, sinks, hybrid, v_dim,
                                                                            monkeypatch) -> None:
    """Requests whose lengths differ (accept lengths after a verify, say) but whose reservations
    start evenly spaced read one common window of positions as one strided view, each row masked
    to what it sees; it equals the dense oracle."""
    views = []
    view = cpu_kernel._strided_view
    monkeypatch.setattr(cpu_kernel, "_strided_view", lambda *a, **k: views.append(a[1].tiles) or view(*a, **k))
    layer = LayerSpec(1, 4, 2, 8, v_dim, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    out, expect = run_cpu_kernel(mode, layer, kv, [q_len] * 3, page_size=4, dtype=torch.float32, seed=17, hybrid=hybrid,
                                contiguous=True, reserved_pages=5)
    assert_close(out, expect, torch.float32)
    assert views and set(views) == {3}


@st.composite
def strided_cases(draw):
    """Requests on consecutive pages, their runs evenly spaced: the batches the strided plan serves."""
    mode = draw(st.sampled_from([M.EXTEND, M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND_V2]))
    q_len = 1 if mode is M.DECODE else draw(st.integers(1, 6))
    b, ps = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 4, 8]))
    if mode is M.EXTEND:
        kv = [q_len + draw(st.integers(0, 20))] * b
    else:
        kv = draw(st.lists(st.integers(q_len, 30), min_size=b, max_size=b))
    window = draw(st.one_of(st.none(), st.integers(0, 8)))
    hkv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    layer = LayerSpec(1, hkv * group, hkv, 8, draw(st.sampled_from([4, 8, 12])), scaling=draw(st.floats(0.05, 1.0)),
                      sliding_window=window, has_sinks=draw(st.booleans()))
    return dict(mode=mode, layer=layer, kv_lens=kv, q_lens=[q_len] * b, page_size=ps,
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), seed=draw(st.integers(0, 2**31 - 1)),
                hybrid=window is not None and draw(st.booleans()), contiguous=True, reserved_pages=-(-max(kv) // ps))


@EXPENSIVE
@given(case=strided_cases(), group_bytes=st.sampled_from([None, 1, 4096]))
def test_strided_plan_matches_dense_oracle(case, group_bytes) -> None:
    saved = tile_plan.STRIDED_GROUP_BYTES
    tile_plan.STRIDED_GROUP_BYTES = saved if group_bytes is None else group_bytes
    try:
        out, expect = run_cpu_kernel(**case)
    finally:
        tile_plan.STRIDED_GROUP_BYTES = saved
    assert_close(out, expect, case["dtype"])


@pytest.mark.parametrize("q_len, window, sinks", [(1, None, True), (4, 3, True), (4, None, False)])
@pytest.mark.parametrize("kv_lens", [[10, 10, 10], [10, 12, 9]])
def test_a_cache_with_gaps_between_pages_is_read_tile_by_tile(q_len, window, sinks, kv_lens, monkeypatch) -> None:
    """A strided plan over a cache whose pages are not evenly spaced slots (a view of every other
    slot block) is read one tile at a time instead, through the same shared mask."""
    in_place = []
    original = cpu_kernel._attend_in_place
    monkeypatch.setattr(cpu_kernel, "_attend_in_place", lambda *a: in_place.append(a[3].tiles) or original(*a))
    gen = torch.Generator().manual_seed(4)
    ps, hkv, dk, dv, b = 4, 2, 8, 12, 3
    layer = LayerSpec(0, 4, hkv, dk, dv, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    k_cache = torch.randn(12, 2 * ps, hkv, dk, generator=gen)[:, :ps]  # page stride of 2 * ps slots
    v_cache = torch.randn(12, 2 * ps, hkv, dv, generator=gen)[:, :ps]
    table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    q = torch.randn(b * q_len, 4, dk, generator=gen)
    sink_logits = torch.randn(4, generator=gen) if sinks else None
    cu = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32)
    plan = tile_plan.plan_attention(kv_lens, [q_len] * b, table, ps, sliding_window=window,
                                              token_bytes=hkv * (dk + dv) * 4, in_place=True)
    assert [g.strided is not None for g in plan.groups] == [True]
    out = paged_attention(q, k_cache, v_cache, table, torch.tensor(kv_lens, dtype=torch.int32), cu, scaling=layer.scaling,
                          sliding_window=window, sinks=sink_logits, plan=plan)
    keys = [k_cache[table[r].long()].reshape(-1, hkv, dk)[: kv_lens[r]] for r in range(b)]
    values = [v_cache[table[r].long()].reshape(-1, hkv, dv)[: kv_lens[r]] for r in range(b)]
    torch.testing.assert_close(out.double(), dense_oracle(q, keys, values, [q_len] * b, layer, sink_logits), atol=1e-5, rtol=1e-5)
    assert in_place == [3]


def test_gather_chunks_group_consecutive_requests_within_the_budget() -> None:
    """The budget counts fp32 K+V of the widest tile times the group size."""
    ps, hkv, dk, dv = 4, 1, 2, 2
    block_table = torch.tensor([[1, 2], [3, 0], [4, 5], [6, 0], [7, 0]])
    kv_lens = [8, 4, 5, 3, 1]  # pages 2, 1, 2, 1, 1
    token = hkv * (dk + dv) * 4
    plan = tile_plan.plan_attention(kv_lens, [1] * 5, block_table, ps, sliding_window=None, token_bytes=token,
                                              chunk_bytes=16 * token)
    assert [g.tiles for g in plan.groups] == [2, 2, 1]  # 8x2 fits, 8x3 does not; 8x2 again; the last alone
    assert [g.pages for g in plan.groups] == [2, 2, 1]
    plan = tile_plan.plan_attention(kv_lens, [1] * 5, block_table, ps, sliding_window=None, token_bytes=token,
                                              chunk_bytes=1)
    assert [g.tiles for g in plan.groups] == [1] * 5


@pytest.mark.parametrize("window, sinks, hybrid", [(None, False, False), (None, True, False), (2, True, True), (5, False, True)])
@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_prefill_cut_into_tiles_matches_dense_oracle(window, sinks, hybrid, chunk_bytes, monkeypatch) -> None:
    """Prompts longer than a tile (tiles of 3 rows here): tiles that start mid-page, end mid-page,
    follow a cached prefix, and are grouped together or one by one."""
    monkeypatch.setattr(tile_plan, "EXTEND_TILE_ROWS", 3)
    if chunk_bytes is not None:
        monkeypatch.setattr(tile_plan, "GATHER_CHUNK_BYTES", chunk_bytes)
    layer = LayerSpec(1, 4, 2, 8, 12, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    out, expect = run_cpu_kernel(M.EXTEND, layer, [23, 10, 1, 7], [11, 10, 1, 2], page_size=4, dtype=torch.float32,
                                seed=5, hybrid=hybrid)
    assert_close(out, expect, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_without_a_prefix_are_causal_squares_and_match_dense_oracle(dtype, monkeypatch) -> None:
    """Without sinks on a full layer, a prompt with no cached prefix is attended as one causal
    square (torch's causal kernel); prompts after a prefix still go by row tiles."""
    monkeypatch.setattr(tile_plan, "EXTEND_TILE_ROWS", 3)
    kv_lens, q_lens = [13, 10, 9, 2], [13, 4, 9, 2]
    plan = tile_plan.plan_attention(kv_lens, q_lens, torch.zeros(4, 4, dtype=torch.int32), 4, sliding_window=None,
                                              token_bytes=64, fused=True)
    assert sorted(g.causal_square for g in plan.groups if g.causal_square) == [9, 13]
    causal = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: causal.append(k.get("is_causal")) or sdpa(*a, **k))
    layer = LayerSpec(1, 4, 2, 8, 8, scaling=8**-0.5)  # the CPU kernel fuses equal qk and v head dims only
    out, expect = run_cpu_kernel(M.EXTEND, layer, kv_lens, q_lens, page_size=4, dtype=dtype, seed=9)
    assert_close(out, expect, dtype)
    assert causal.count(True) == 2  # the two prompts without a prefix


@pytest.mark.parametrize("window", [None, 4])
def test_prompt_tiles_through_torchs_fused_attention_match_dense_oracle(window, monkeypatch) -> None:
    """Prompt tiles after a cached prefix (no sinks, qk == v dims) go through torch's fused
    attention with a mask; tiles of 3 rows here, each fused."""
    monkeypatch.setattr(tile_plan, "EXTEND_TILE_ROWS", 3)
    monkeypatch.setattr(cpu_kernel, "FUSED_MIN_ROWS", 3)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(k.get("attn_mask") is not None) or sdpa(*a, **k))
    layer = LayerSpec(1, 4, 2, 8, 8, scaling=8**-0.5, sliding_window=window)
    out, expect = run_cpu_kernel(M.EXTEND, layer, [23, 10, 9], [12, 6, 3], page_size=4, dtype=torch.float32, seed=11)
    assert_close(out, expect, torch.float32)
    assert calls and all(calls)  # every tile went through the masked fused kernel


def test_a_causal_square_refuses_sinks() -> None:
    from hal.errors import SpecError

    plan = tile_plan.plan_attention([200], [200], torch.arange(1, 51, dtype=torch.int32).view(1, 50), 4,
                                              sliding_window=None, token_bytes=64, fused=True)
    cache = torch.zeros(51, 4, 1, 8)
    with pytest.raises(SpecError, match="take no sinks"):
        paged_attention(torch.zeros(200, 2, 8), cache, cache, torch.zeros(1, 50, dtype=torch.int32), torch.tensor([200]),
                        torch.tensor([0, 200]), scaling=1.0, sinks=torch.zeros(2), plan=plan)


@pytest.mark.parametrize("kv_len", [64, 1024, 16384])
def test_sliding_window_tiles_gather_only_the_window_pages(kv_len) -> None:
    """A window layer's decode and verify tiles read the pages of the last W + rows positions,
    however long the context; a prefill tile reads its rows plus W keys before them."""
    ps, window = 16, 20
    pages = -(-kv_len // ps)
    table = torch.arange(1, pages + 1)[None, :]
    for q_len in (1, 4):
        plan = tile_plan.plan_attention([kv_len], [q_len], table, ps, sliding_window=window, token_bytes=8)
        (group,) = plan.groups
        first_key = kv_len - q_len - window
        assert group.pages == pages - first_key // ps  # the pages from the one holding the oldest visible key
        assert torch.equal(group.page_ids, torch.arange(first_key // ps + 1, pages + 1))
    plan = tile_plan.plan_attention([kv_len], [kv_len], table, ps, sliding_window=window, token_bytes=8)
    rows = tile_plan.EXTEND_TILE_ROWS
    assert sum(g.tiles for g in plan.groups) == -(-kv_len // rows)
    assert max(g.pages for g in plan.groups) <= -(-(rows + window) // ps) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_workspace_reuse_across_calls_of_changing_size_matches_fresh_buffers(dtype) -> None:
    """One workspace serving a large call, a smaller one and a larger one again gives the same
    output as a call that gathers into new tensors (stale contents never leak in)."""
    gen = torch.Generator().manual_seed(3)
    ps, hkv, hq, dk, dv = 4, 2, 4, 8, 6
    k_cache = torch.randn(12, ps, hkv, dk, generator=gen).to(dtype)
    v_cache = torch.randn(12, ps, hkv, dv, generator=gen).to(dtype)
    ws = cpu_kernel.GatherWorkspace()
    for kv_lens, table in (([9, 7], [[3, 1, 5], [2, 8, 0]]), ([3], [[11, 0, 0]]), ([12, 5, 8], [[4, 6, 7], [9, 10, 0], [1, 2, 0]])):
        b = len(kv_lens)
        q = torch.randn(b, hq, dk, generator=gen).to(dtype)
        args = (q, k_cache, v_cache, torch.tensor(table), torch.tensor(kv_lens), torch.arange(b + 1))
        fresh = paged_attention(*args, scaling=0.3)
        reused = paged_attention(*args, scaling=0.3, workspace=ws)
        assert torch.equal(reused, fresh)


def test_gradients_through_calls_sharing_a_workspace_equal_those_without_one() -> None:
    """Two calls sharing one workspace, then one backward through both: the gradients of q, K and V
    equal those of calls that gather into new tensors (nothing autograd saved was overwritten by
    the second call), and those of the dense oracle."""
    gen = torch.Generator().manual_seed(5)
    ps, hkv, hq, dk, dv = 4, 2, 4, 8, 6
    kv_lens, q_lens, table = [9, 7], [3, 2], torch.tensor([[3, 1, 5], [2, 8, 0]])
    other_table = torch.tensor([[4, 6, 11], [10, 9, 0]])  # the second call gathers other pages
    cu = torch.tensor([0, 3, 5])
    leaves = [torch.randn(5, hq, dk, generator=gen), torch.randn(5, hq, dk, generator=gen),
              torch.randn(12, ps, hkv, dk, generator=gen), torch.randn(12, ps, hkv, dv, generator=gen)]

    def grads(workspace: cpu_kernel.GatherWorkspace | None, cache_grads: bool) -> list[torch.Tensor | None]:
        q1, q2 = (x.clone().requires_grad_() for x in leaves[:2])
        k, v = (x.clone().requires_grad_(cache_grads) for x in leaves[2:])
        outs = [paged_attention(q, k, v, t, torch.tensor(kv_lens), cu, scaling=0.3, workspace=workspace)
                for q, t in ((q1, table), (q2, other_table))]
        (outs[0] * 2 + outs[1]).sum().backward()
        return [x.grad for x in (q1, q2, k, v)]

    for cache_grads in (True, False):  # K/V saved for q's gradient alone must not be overwritten either
        fresh, shared = grads(None, cache_grads), grads(cpu_kernel.GatherWorkspace(), cache_grads)
        for a, b in zip(shared, fresh):
            assert (a is None and b is None) or torch.allclose(a, b, atol=1e-6)
    q = leaves[0].clone().requires_grad_()
    keys = [leaves[2][table[b]].reshape(-1, hkv, dk)[:n] for b, n in enumerate(kv_lens)]
    values = [leaves[3][table[b]].reshape(-1, hkv, dv)[:n] for b, n in enumerate(kv_lens)]
    expect = dense_attention(q, keys, values, q_lens, scaling=0.3)
    assert torch.allclose(fresh[0], torch.autograd.grad((expect * 2).sum(), q)[0], atol=1e-5)


def test_a_gathered_decode_step_where_every_row_sees_every_key_carries_no_mask() -> None:
    """Equal requests on scattered pages (SGLang's interleaved decode slots): the plan gathers them
    with no mask to rebuild per layer; one shorter request brings the mask back, and both equal the oracle."""
    gen = torch.Generator().manual_seed(7)
    ps, hkv, hq, dk = 1, 2, 4, 8
    k_cache, v_cache = torch.randn(64, ps, hkv, dk, generator=gen), torch.randn(64, ps, hkv, dk, generator=gen)
    table = (1 + torch.arange(12)[None, :] * 4 + torch.arange(4)[:, None])  # request r at slots 1 + 4p + r
    for kv_lens in ([12, 12, 12, 12], [12, 12, 9, 12]):
        plan = tile_plan.plan_attention(kv_lens, [1] * 4, table, ps, sliding_window=None, token_bytes=64, in_place=True)
        (group,) = plan.groups
        assert (group.blocked is None) == (len(set(kv_lens)) == 1)
        q = torch.randn(4, hq, dk, generator=gen)
        out = paged_attention(q, k_cache, v_cache, table, torch.tensor(kv_lens), torch.arange(5), scaling=0.3, plan=plan)
        keys = [k_cache[table[b, :n]].reshape(n, hkv, dk) for b, n in enumerate(kv_lens)]
        values = [v_cache[table[b, :n]].reshape(n, hkv, dk) for b, n in enumerate(kv_lens)]
        assert torch.allclose(out, dense_attention(q, keys, values, [1] * 4, scaling=0.3).float(), atol=1e-5)


TREES = tree_cases()


@pytest.mark.parametrize("case", TREES, ids=lambda c: c.describe())
@pytest.mark.parametrize("one_request_per_chunk", [False, True])
def test_tree_verify_matches_the_oracle(case, one_request_per_chunk, monkeypatch) -> None:
    """A verify block over a draft tree is one tile whose mask follows the tree, gathered in groups
    or one request per group; NaN/inf in the slots no row sees stay out."""
    if one_request_per_chunk:
        monkeypatch.setattr(tile_plan, "GATHER_CHUNK_BYTES", 1)
    result = run_attention_case(CpuBackend(), case)
    assert result.passed, result.detail
    assert run_attention_case(CpuBackend(), case, poison_unseen=True).passed


@pytest.mark.parametrize("window, sinks, hybrid", [(None, False, False), (2, True, False), (3, True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_dim", [8, 12])
def test_tree_verify_on_consecutive_pages_is_read_in_place_and_matches_the_oracle(window, sinks, hybrid, dtype, v_dim,
                                                                                   monkeypatch) -> None:
    monkeypatch.setattr(tile_plan, "VIEW_MIN_TILE_BYTES", 0)
    in_place = []
    original = cpu_kernel._attend_in_place
    monkeypatch.setattr(cpu_kernel, "_attend_in_place", lambda *a: in_place.append(a[3].tiles) or original(*a))
    layer = LayerSpec(1, 4, 2, 8, v_dim, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    parents = [[-1, 0, 0, 1, 2, 4], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0]]
    out, expect = run_cpu_kernel(M.TARGET_VERIFY, layer, [19, 6, 11], [6] * 3, page_size=4, dtype=dtype, seed=5,
                                 hybrid=hybrid, contiguous=True, tree_parents=parents)
    assert_close(out, expect, dtype)
    assert in_place


@pytest.mark.parametrize("window", [None, 4])
def test_a_tree_of_many_rows_through_torchs_fused_attention_matches_the_oracle(window, monkeypatch) -> None:
    """A verify block of at least FUSED_MIN_ROWS rows with qk == v and no sinks goes through torch's
    fused attention with the tree's mask."""
    fused_calls = []
    original = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: fused_calls.append(1) or original(*a, **k))
    rng = random.Random(3)
    n = cpu_kernel.FUSED_MIN_ROWS + 4
    parents = [[-1] + [rng.randrange(i) for i in range(1, n)] for _ in range(2)]
    layer = LayerSpec(1, 4, 2, 8, 8, scaling=8**-0.5, sliding_window=window)
    out, expect = run_cpu_kernel(M.TARGET_VERIFY, layer, [n + 7, n], [n, n], page_size=4, dtype=torch.float32, seed=2,
                                 tree_parents=parents)
    assert_close(out, expect, torch.float32)
    assert fused_calls


@pytest.mark.parametrize("q_len", [5, cpu_kernel.FUSED_MIN_ROWS + 4])
def test_a_nan_key_in_a_new_row_reaches_only_the_rows_that_see_it(q_len: int) -> None:
    """One request with 6 keys in the pool, a verify block whose second row's key is NaN: row 0
    (the prefix and itself) is the oracle's and finite, every later row NaN, as the oracle's; on
    the explicit, flash and fused paths alike."""
    from hal.oracle import paged_oracle

    backend = CpuBackend()
    pool = backend.create_kv_pool(KVPoolSpec(1, 128, 16, 2, 32, 32, torch.float32))
    kernel = backend.create_attention(pool)
    layer = LayerSpec(0, 4, 2, 32, 32, 32**-0.5)
    gen = torch.Generator().manual_seed(1)
    prefix = build_metadata(ForwardMode.EXTEND, kv_lens=[6], q_lens=[6], page_table=[[1, 2, 3]], out_cache_loc=list(range(16, 22)), pool=pool)
    kernel.forward(*(torch.randn(6, h, 32, generator=gen) for h in (4, 2, 2)), layer, kernel.plan(prefix))
    md = build_metadata(ForwardMode.TARGET_VERIFY, kv_lens=[6 + q_len], q_lens=[q_len], page_table=[[1, 2, 3]],
                        out_cache_loc=list(range(22, 22 + q_len)), pool=pool)
    q, k, v = (torch.randn(q_len, h, 32, generator=gen) for h in (4, 2, 2))
    k[1] = float("nan")
    out = kernel.forward(q, k, v, layer, kernel.plan(md))
    expect = paged_oracle(q, pool.k_buffer(0), pool.v_buffer(0), md.block_table, md.kv_lens, md.cu_q_lens, scaling=layer.scaling)
    assert out[0].isfinite().all() and out[1:].isnan().all()
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5, equal_nan=True)
