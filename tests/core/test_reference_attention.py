"""The CPU reference attention against a naive dense softmax written independently here.

The oracle loops over requests, query rows and heads, builds each row's dense visibility mask
from the rule in hal.spec / hal.metadata (query at position p sees keys j <= p, and j >= p - W on
a window layer), and does the softmax in float64 with the sink added to the denominator.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hal.reference as reference_attention
from hal.backends.cpu import CpuBackend
from hal.reference import paged_attention
from hal.metadata import build_metadata
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec
from hal.tools.testing import TOLERANCE

M = ForwardMode
EXPENSIVE = settings.get_profile("hal-expensive")


def dense_oracle(
    q: torch.Tensor,  # [T, Hq, Dk]
    keys: list[torch.Tensor],  # per request [kv_len, Hkv, Dk]
    values: list[torch.Tensor],  # per request [kv_len, Hkv, Dv]
    q_lens: list[int],
    layer: LayerSpec,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    hq, dv = q.shape[1], values[0].shape[2] if values else layer.v_head_dim
    group = layer.num_q_heads // layer.num_kv_heads
    out = torch.zeros(q.shape[0], hq, dv, dtype=torch.float64)
    row = 0
    for b, q_len in enumerate(q_lens):
        kv_len = keys[b].shape[0]
        j = torch.arange(kv_len)
        for i in range(q_len):
            p = kv_len - q_len + i
            visible = j <= p
            if layer.sliding_window is not None:
                visible &= j >= p - layer.sliding_window
            for h in range(hq):
                kv_head = h // group
                if not bool(visible.any()):
                    continue  # a row that sees no key is 0, sink or not
                scores = (keys[b][:, kv_head].double() @ q[row, h].double()) * layer.scaling
                scores = scores[visible]
                terms = [scores] if sinks is None else [scores, sinks[h : h + 1].double()]
                peak = torch.cat(terms).max()
                weights = torch.exp(scores - peak)
                denom = weights.sum() + (0.0 if sinks is None else torch.exp(sinks[h].double() - peak))
                out[row, h] = (weights[:, None] * values[b][visible, kv_head].double()).sum(0) / denom
            row += 1
    return out


def run_reference(
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
    md = build_metadata(mode, kv_lens=kv_lens, q_lens=q_lens, page_table=rows, out_cache_loc=new_loc, pool=pool)
    before = [t.clone() for pair in pool.sub_pool_buffers().values() for t in pair]
    out = backend.create_attention(pool).forward(q, k_new, v_new, layer, md, save_kv_cache=save_kv_cache, sinks=sinks)
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
    return out, dense_oracle(q, keys, values, q_lens, layer, sinks)


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
def test_reference_matches_dense_oracle(case) -> None:
    out, expect = run_reference(**case)
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
    out, expect = run_reference(mode, layer, kv, q, page_size=4, dtype=dtype, seed=len(kv) * 7 + int(mode), hybrid=hybrid)
    assert_close(out, expect, dtype)


@pytest.mark.parametrize("mode", [M.EXTEND, M.DECODE, M.TARGET_VERIFY])
@pytest.mark.parametrize("window, sinks, hybrid", [(None, True, False), (3, True, True)])
def test_one_request_per_gather_chunk_matches_dense_oracle(mode, window, sinks, hybrid, monkeypatch) -> None:
    """A chunk budget below one request's K/V attends every request in its own group."""
    monkeypatch.setattr(reference_attention, "GATHER_CHUNK_BYTES", 1)
    layer = LayerSpec(1, 4, 2, 8, 12, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    kv = [19, 4, 0, 9] if mode is M.EXTEND else [19, 4, 9]
    q = [7, 4, 0, 9] if mode is M.EXTEND else [{M.DECODE: 1, M.TARGET_VERIFY: 4}[mode]] * 3
    out, expect = run_reference(mode, layer, kv, q, page_size=4, dtype=torch.float32, seed=11, hybrid=hybrid)
    assert_close(out, expect, torch.float32)


@pytest.mark.parametrize("mode", [M.EXTEND, M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND_V2])
@pytest.mark.parametrize("window, sinks, hybrid", [(None, False, False), (None, True, False), (3, False, False), (3, True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consecutive_pages_are_read_in_place_and_match_dense_oracle(mode, window, sinks, hybrid, dtype, monkeypatch) -> None:
    """Requests whose pages are consecutive in the pool are attended over views of the cache (no
    gather), one tile at a time; shuffled pages are gathered. Both equal the dense oracle."""
    monkeypatch.setattr(reference_attention, "VIEW_MIN_TILE_BYTES", 0)
    monkeypatch.setattr(reference_attention, "EXTEND_TILE_ROWS", 3)  # prompt tiles below FUSED_MIN_ROWS
    in_place = []
    original = reference_attention._attend_in_place
    monkeypatch.setattr(reference_attention, "_attend_in_place", lambda *a: in_place.append(a[3].tiles) or original(*a))
    layer = LayerSpec(1, 4, 2, 8, 12, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    q_len = {M.EXTEND: None, M.DECODE: 1, M.TARGET_VERIFY: 4, M.DRAFT_EXTEND_V2: 4}[mode]
    kv = [19, 4, 9]
    q = [7, 4, 9] if q_len is None else [q_len] * 3
    for contiguous in (True, False):
        in_place.clear()
        out, expect = run_reference(mode, layer, kv, q, page_size=4, dtype=dtype, seed=3, hybrid=hybrid, contiguous=contiguous)
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
        monkeypatch.setattr(reference_attention, "STRIDED_GROUP_BYTES", group_bytes)
    views, flash = [], []
    view, attention = reference_attention._strided_view, reference_attention._attention
    monkeypatch.setattr(reference_attention, "_strided_view", lambda *a, **k: views.append(a[1].tiles) or view(*a, **k))
    monkeypatch.setattr(reference_attention, "_attention",
                        lambda qt, keys, values, *a: flash.append(values.shape[3] == keys.shape[3]) or attention(qt, keys, values, *a))
    layer = LayerSpec(1, 4, 2, 8, v_dim, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    q_len = {M.DECODE: 1, M.TARGET_VERIFY: 4, M.DRAFT_EXTEND_V2: 4}[mode]
    out, expect = run_reference(mode, layer, [10, 10, 10], [q_len] * 3, page_size=4, dtype=dtype, seed=9, hybrid=hybrid,
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
    view = reference_attention._strided_view
    monkeypatch.setattr(reference_attention, "_strided_view", lambda *a, **k: views.append(a[1].tiles) or view(*a, **k))
    layer = LayerSpec(1, 4, 2, 8, v_dim, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    out, expect = run_reference(mode, layer, kv, [q_len] * 3, page_size=4, dtype=torch.float32, seed=17, hybrid=hybrid,
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
    saved = reference_attention.STRIDED_GROUP_BYTES
    reference_attention.STRIDED_GROUP_BYTES = saved if group_bytes is None else group_bytes
    try:
        out, expect = run_reference(**case)
    finally:
        reference_attention.STRIDED_GROUP_BYTES = saved
    assert_close(out, expect, case["dtype"])


@pytest.mark.parametrize("q_len, window, sinks", [(1, None, True), (4, 3, True), (4, None, False)])
@pytest.mark.parametrize("kv_lens", [[10, 10, 10], [10, 12, 9]])
def test_a_cache_with_gaps_between_pages_is_read_tile_by_tile(q_len, window, sinks, kv_lens, monkeypatch) -> None:
    """A strided plan over a cache whose pages are not evenly spaced slots (a view of every other
    slot block) is read one tile at a time instead, through the same shared mask."""
    in_place = []
    original = reference_attention._attend_in_place
    monkeypatch.setattr(reference_attention, "_attend_in_place", lambda *a: in_place.append(a[3].tiles) or original(*a))
    gen = torch.Generator().manual_seed(4)
    ps, hkv, dk, dv, b = 4, 2, 8, 12, 3
    layer = LayerSpec(0, 4, hkv, dk, dv, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    k_cache = torch.randn(12, 2 * ps, hkv, dk, generator=gen)[:, :ps]  # page stride of 2 * ps slots
    v_cache = torch.randn(12, 2 * ps, hkv, dv, generator=gen)[:, :ps]
    table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
    q = torch.randn(b * q_len, 4, dk, generator=gen)
    sink_logits = torch.randn(4, generator=gen) if sinks else None
    cu = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32)
    plan = reference_attention.plan_attention(kv_lens, [q_len] * b, table, ps, sliding_window=window,
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
    plan = reference_attention.plan_attention(kv_lens, [1] * 5, block_table, ps, sliding_window=None, token_bytes=token,
                                              chunk_bytes=16 * token)
    assert [g.tiles for g in plan.groups] == [2, 2, 1]  # 8x2 fits, 8x3 does not; 8x2 again; the last alone
    assert [g.pages for g in plan.groups] == [2, 2, 1]
    plan = reference_attention.plan_attention(kv_lens, [1] * 5, block_table, ps, sliding_window=None, token_bytes=token,
                                              chunk_bytes=1)
    assert [g.tiles for g in plan.groups] == [1] * 5


@pytest.mark.parametrize("window, sinks, hybrid", [(None, False, False), (None, True, False), (2, True, True), (5, False, True)])
@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_prefill_cut_into_tiles_matches_dense_oracle(window, sinks, hybrid, chunk_bytes, monkeypatch) -> None:
    """Prompts longer than a tile (tiles of 3 rows here): tiles that start mid-page, end mid-page,
    follow a cached prefix, and are grouped together or one by one."""
    monkeypatch.setattr(reference_attention, "EXTEND_TILE_ROWS", 3)
    if chunk_bytes is not None:
        monkeypatch.setattr(reference_attention, "GATHER_CHUNK_BYTES", chunk_bytes)
    layer = LayerSpec(1, 4, 2, 8, 12, scaling=8**-0.5, sliding_window=window, has_sinks=sinks)
    out, expect = run_reference(M.EXTEND, layer, [23, 10, 1, 7], [11, 10, 1, 2], page_size=4, dtype=torch.float32,
                                seed=5, hybrid=hybrid)
    assert_close(out, expect, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_without_a_prefix_are_causal_squares_and_match_dense_oracle(dtype, monkeypatch) -> None:
    """Without sinks on a full layer, a prompt with no cached prefix is attended as one causal
    square (torch's causal kernel); prompts after a prefix still go by row tiles."""
    monkeypatch.setattr(reference_attention, "EXTEND_TILE_ROWS", 3)
    kv_lens, q_lens = [13, 10, 9, 2], [13, 4, 9, 2]
    plan = reference_attention.plan_attention(kv_lens, q_lens, torch.zeros(4, 4, dtype=torch.int32), 4, sliding_window=None,
                                              token_bytes=64, fused=True)
    assert sorted(g.causal_square for g in plan.groups if g.causal_square) == [9, 13]
    causal = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: causal.append(k.get("is_causal")) or sdpa(*a, **k))
    layer = LayerSpec(1, 4, 2, 8, 8, scaling=8**-0.5)  # the CPU kernel fuses equal qk and v head dims only
    out, expect = run_reference(M.EXTEND, layer, kv_lens, q_lens, page_size=4, dtype=dtype, seed=9)
    assert_close(out, expect, dtype)
    assert causal.count(True) == 2  # the two prompts without a prefix


@pytest.mark.parametrize("window", [None, 4])
def test_prompt_tiles_through_torchs_fused_attention_match_dense_oracle(window, monkeypatch) -> None:
    """Prompt tiles after a cached prefix (no sinks, qk == v dims) go through torch's fused
    attention with a mask; tiles of 3 rows here, each fused."""
    monkeypatch.setattr(reference_attention, "EXTEND_TILE_ROWS", 3)
    monkeypatch.setattr(reference_attention, "FUSED_MIN_ROWS", 3)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(k.get("attn_mask") is not None) or sdpa(*a, **k))
    layer = LayerSpec(1, 4, 2, 8, 8, scaling=8**-0.5, sliding_window=window)
    out, expect = run_reference(M.EXTEND, layer, [23, 10, 9], [12, 6, 3], page_size=4, dtype=torch.float32, seed=11)
    assert_close(out, expect, torch.float32)
    assert calls and all(calls)  # every tile went through the masked fused kernel


def test_a_causal_square_refuses_sinks() -> None:
    from hal.errors import SpecError

    plan = reference_attention.plan_attention([200], [200], torch.arange(1, 51, dtype=torch.int32).view(1, 50), 4,
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
        plan = reference_attention.plan_attention([kv_len], [q_len], table, ps, sliding_window=window, token_bytes=8)
        (group,) = plan.groups
        first_key = kv_len - q_len - window
        assert group.pages == pages - first_key // ps  # the pages from the one holding the oldest visible key
        assert torch.equal(group.page_ids, torch.arange(first_key // ps + 1, pages + 1))
    plan = reference_attention.plan_attention([kv_len], [kv_len], table, ps, sliding_window=window, token_bytes=8)
    rows = reference_attention.EXTEND_TILE_ROWS
    assert sum(g.tiles for g in plan.groups) == -(-kv_len // rows)
    assert max(g.pages for g in plan.groups) <= -(-(rows + window) // ps) + 1


# -- hand-computed cases: q = 0 makes every visible score 0, so each output is a plain average ----------


def one_layer_pool(kv_len: int, heads: int, dv: int, values: torch.Tensor, page_size: int = 4):
    """A one-request pool whose tokens 0..kv_len-1 hold K = 0 and the given V; returns (pool, md, loc)."""
    pool = CpuBackend().create_kv_pool(KVPoolSpec(1, 4 * page_size, page_size, heads, 2, dv))
    pages = [1, 2, 3, 4][: -(-kv_len // page_size)]
    loc = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(kv_len)])
    pool.set_kv(0, loc, torch.zeros(kv_len, heads, 2), values)
    return pool, pages, loc


def test_window_off_by_one_hand_case() -> None:
    # W = 2, query at position 4 of 5 tokens sees keys 2, 3, 4 (W + 1 keys); V_j = e_j.
    kv_len, window = 5, 2
    values = torch.eye(kv_len).view(kv_len, 1, kv_len)
    pool, pages, _ = one_layer_pool(kv_len, 1, kv_len, values)
    layer = LayerSpec(0, 1, 1, 2, kv_len, scaling=1.0, sliding_window=window)
    md = build_metadata(M.EXTEND, kv_lens=[kv_len], q_lens=[kv_len], page_table=[pages], out_cache_loc=list(range(kv_len)), pool=pool)
    out = CpuBackend().create_attention(pool).forward(torch.zeros(kv_len, 1, 2), None, None, layer, md, save_kv_cache=False)
    third, half = 1 / 3, 1 / 2
    expect = torch.tensor(
        [
            [1, 0, 0, 0, 0],  # position 0 sees only itself
            [half, half, 0, 0, 0],  # position 1 sees 0, 1
            [third, third, third, 0, 0],  # position 2 sees 0 (= p - W), 1, 2
            [0, third, third, third, 0],  # position 3: key 1 = p - W visible, key 0 = p - W - 1 not
            [0, 0, third, third, third],
        ]
    )
    torch.testing.assert_close(out[:, 0], expect)


def test_window_zero_sees_only_itself_and_none_sees_all() -> None:
    values = torch.eye(3).view(3, 1, 3)
    pool, pages, _ = one_layer_pool(3, 1, 3, values)
    attn = CpuBackend().create_attention(pool)
    md = build_metadata(M.DECODE, kv_lens=[3], q_lens=[1], page_table=[pages], out_cache_loc=[2], pool=pool)
    q = torch.zeros(1, 1, 2)
    own = attn.forward(q, None, None, LayerSpec(0, 1, 1, 2, 3, scaling=1.0, sliding_window=0), md, save_kv_cache=False)
    full = attn.forward(q, None, None, LayerSpec(0, 1, 1, 2, 3, scaling=1.0), md, save_kv_cache=False)
    torch.testing.assert_close(own[0, 0], torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(full[0, 0], torch.tensor([1 / 3, 1 / 3, 1 / 3]))


def test_sinks_only_enlarge_the_denominator_hand_case() -> None:
    # Two keys with equal scores and V = e_0, e_1. A sink s adds exp(s) to the denominator:
    # s = ln 2 -> each weight 1 / (2 + 2) = 1/4; s = 0 -> 1/3; s = -100 -> ~1/2.
    values = torch.eye(2).view(2, 1, 2).expand(2, 3, 2).contiguous()
    pool, pages, _ = one_layer_pool(2, 3, 2, values)
    layer = LayerSpec(0, 3, 3, 2, 2, scaling=1.0, has_sinks=True)
    md = build_metadata(M.DECODE, kv_lens=[2], q_lens=[1], page_table=[pages], out_cache_loc=[1], pool=pool)
    sinks = torch.tensor([math.log(2.0), 0.0, -100.0])
    out = CpuBackend().create_attention(pool).forward(torch.zeros(1, 3, 2), None, None, layer, md, save_kv_cache=False, sinks=sinks)
    torch.testing.assert_close(out[0], torch.tensor([[0.25, 0.25], [1 / 3, 1 / 3], [0.5, 0.5]]))


def test_gqa_query_head_uses_kv_head_h_div_group() -> None:
    # 4 query heads over 2 kv heads: heads 0, 1 read kv head 0 (V = 1), heads 2, 3 read kv head 1 (V = 2).
    values = torch.tensor([1.0, 2.0]).view(1, 2, 1).expand(3, 2, 1).contiguous()
    pool, pages, _ = one_layer_pool(3, 2, 1, values)
    layer = LayerSpec(0, 4, 2, 2, 1, scaling=1.0)
    md = build_metadata(M.DECODE, kv_lens=[3], q_lens=[1], page_table=[pages], out_cache_loc=[2], pool=pool)
    out = CpuBackend().create_attention(pool).forward(torch.zeros(1, 4, 2), None, None, layer, md, save_kv_cache=False)
    assert out[0, :, 0].tolist() == [1.0, 1.0, 2.0, 2.0]


def test_scaling_multiplies_the_scores_hand_case() -> None:
    # K_0 = (1, 0), K_1 = (0, 0), q = (1, 0): scores (s, 0), so weight of key 0 is e^s / (e^s + 1).
    pool = CpuBackend().create_kv_pool(KVPoolSpec(1, 8, 4, 1, 2, 1))
    pool.set_kv(0, torch.tensor([4, 5]), torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]]]), torch.tensor([[[1.0]], [[0.0]]]))
    md = build_metadata(M.DECODE, kv_lens=[2], q_lens=[1], page_table=[[1]], out_cache_loc=[5], pool=pool)
    q = torch.tensor([[[1.0, 0.0]]])
    for s in (0.5, 2.0):
        out = CpuBackend().create_attention(pool).forward(q, None, None, LayerSpec(0, 1, 1, 2, 1, scaling=s), md, save_kv_cache=False)
        assert float(out) == pytest.approx(math.exp(s) / (math.exp(s) + 1), rel=1e-6)


def test_rows_that_see_no_key_are_zero() -> None:
    # paged_attention with kv_len < q_len (what a padded row with no keys looks like): request 0 has
    # one query at position -1 and no keys; request 1's first query (position -1) sees nothing either.
    pool = CpuBackend().create_kv_pool(KVPoolSpec(1, 8, 4, 1, 2, 1))
    pool.k_buffer(0).normal_()
    pool.v_buffer(0).fill_(5.0)
    q = torch.randn(3, 2, 2)
    for sinks in (None, torch.tensor([0.5, -0.5])):
        out = paged_attention(
            q,
            pool.k_buffer(0),
            pool.v_buffer(0),
            torch.tensor([[1], [2]], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0, 1, 3], dtype=torch.int32),
            scaling=1.0,
            sinks=sinks,
        )
        assert out[0].abs().sum() == 0 and out[1].abs().sum() == 0
        # The last row (position 0) sees its one key: the output is that key's V, shrunk by a sink.
        expect = torch.full((2, 1), 5.0)
        if sinks is not None:
            score = q[2] @ pool.k_buffer(0)[2, 0, 0]
            expect = 5.0 * torch.exp(score) / (torch.exp(score) + torch.exp(sinks))
            expect = expect[:, None]
        torch.testing.assert_close(out[2], expect)


def test_empty_batch_returns_empty_output() -> None:
    pool = CpuBackend().create_kv_pool(KVPoolSpec(1, 8, 4, 1, 2, 3))
    md = build_metadata(M.DECODE, kv_lens=[], q_lens=[], page_table=[], out_cache_loc=[], pool=pool)
    empty = torch.zeros(0, 2, 2)
    out = CpuBackend().create_attention(pool).forward(empty, torch.zeros(0, 1, 2), torch.zeros(0, 1, 3), LayerSpec(0, 2, 1, 2, 3, 1.0), md)
    assert out.shape == (0, 2, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_workspace_reuse_across_calls_of_changing_size_matches_fresh_buffers(dtype) -> None:
    """One workspace serving a large call, a smaller one and a larger one again gives the same
    output as a call that gathers into new tensors (stale contents never leak in)."""
    gen = torch.Generator().manual_seed(3)
    ps, hkv, hq, dk, dv = 4, 2, 4, 8, 6
    k_cache = torch.randn(12, ps, hkv, dk, generator=gen).to(dtype)
    v_cache = torch.randn(12, ps, hkv, dv, generator=gen).to(dtype)
    ws = reference_attention.GatherWorkspace()
    for kv_lens, table in (([9, 7], [[3, 1, 5], [2, 8, 0]]), ([3], [[11, 0, 0]]), ([12, 5, 8], [[4, 6, 7], [9, 10, 0], [1, 2, 0]])):
        b = len(kv_lens)
        q = torch.randn(b, hq, dk, generator=gen).to(dtype)
        args = (q, k_cache, v_cache, torch.tensor(table), torch.tensor(kv_lens), torch.arange(b + 1))
        fresh = paged_attention(*args, scaling=0.3)
        reused = paged_attention(*args, scaling=0.3, workspace=ws)
        assert torch.equal(reused, fresh)
