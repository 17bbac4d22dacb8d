"""The oracle (``hal.oracle``) against the definition, twice over: a per-row, per-head float64
loop written independently here, on random batches, and hand-computed cases (which the CPU
backend's kernel must meet too)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hal.backends.cpu import CpuBackend
from hal.backends.cpu.paged_attention import paged_attention
from hal.metadata import build_metadata
from hal.oracle import OracleAttention, dense_attention, paged_oracle
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec

M = ForwardMode


def dense_loop_oracle(
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


class _Kernel:
    """A kernel factory over a pool, and the paged function with the kernels' common signature."""

    def __init__(self, name: str, make, paged) -> None:
        self.name, self.make, self.paged = name, make, paged

    def __call__(self, pool):
        return self.make(pool)

    def __repr__(self) -> str:
        return self.name


KERNELS = pytest.mark.parametrize("make_kernel", [
    _Kernel("oracle", OracleAttention, paged_oracle),
    _Kernel("cpu", lambda pool: CpuBackend().create_attention(pool), paged_attention),
], ids=repr)


# -- hand-computed cases: q = 0 makes every visible score 0, so each output is a plain average ----------


def one_layer_pool(kv_len: int, heads: int, dv: int, values: torch.Tensor, page_size: int = 4):
    """A one-request pool whose tokens 0..kv_len-1 hold K = 0 and the given V; returns (pool, md, loc)."""
    pool = CpuBackend().create_kv_pool(KVPoolSpec(1, 4 * page_size, page_size, heads, 2, dv))
    pages = [1, 2, 3, 4][: -(-kv_len // page_size)]
    loc = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(kv_len)])
    pool.set_kv(0, loc, torch.zeros(kv_len, heads, 2), values)
    return pool, pages, loc


@KERNELS
def test_window_off_by_one_hand_case(make_kernel) -> None:
    # W = 2, query at position 4 of 5 tokens sees keys 2, 3, 4 (W + 1 keys); V_j = e_j.
    kv_len, window = 5, 2
    values = torch.eye(kv_len).view(kv_len, 1, kv_len)
    pool, pages, _ = one_layer_pool(kv_len, 1, kv_len, values)
    layer = LayerSpec(0, 1, 1, 2, kv_len, scaling=1.0, sliding_window=window)
    md = build_metadata(M.EXTEND, kv_lens=[kv_len], q_lens=[kv_len], page_table=[pages], out_cache_loc=list(range(kv_len)), pool=pool)
    out = (kernel := make_kernel(pool)).forward(torch.zeros(kv_len, 1, 2), None, None, layer, kernel.plan(md), save_kv_cache=False)
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


@KERNELS
def test_window_zero_sees_only_itself_and_none_sees_all(make_kernel) -> None:
    values = torch.eye(3).view(3, 1, 3)
    pool, pages, _ = one_layer_pool(3, 1, 3, values)
    attn = make_kernel(pool)
    md = build_metadata(M.DECODE, kv_lens=[3], q_lens=[1], page_table=[pages], out_cache_loc=[2], pool=pool)
    q = torch.zeros(1, 1, 2)
    own = attn.forward(q, None, None, LayerSpec(0, 1, 1, 2, 3, scaling=1.0, sliding_window=0), attn.plan(md), save_kv_cache=False)
    full = attn.forward(q, None, None, LayerSpec(0, 1, 1, 2, 3, scaling=1.0), attn.plan(md), save_kv_cache=False)
    torch.testing.assert_close(own[0, 0], torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(full[0, 0], torch.tensor([1 / 3, 1 / 3, 1 / 3]))


@KERNELS
def test_sinks_only_enlarge_the_denominator_hand_case(make_kernel) -> None:
    # Two keys with equal scores and V = e_0, e_1. A sink s adds exp(s) to the denominator:
    # s = ln 2 -> each weight 1 / (2 + 2) = 1/4; s = 0 -> 1/3; s = -100 -> ~1/2.
    values = torch.eye(2).view(2, 1, 2).expand(2, 3, 2).contiguous()
    pool, pages, _ = one_layer_pool(2, 3, 2, values)
    layer = LayerSpec(0, 3, 3, 2, 2, scaling=1.0, has_sinks=True)
    md = build_metadata(M.DECODE, kv_lens=[2], q_lens=[1], page_table=[pages], out_cache_loc=[1], pool=pool)
    sinks = torch.tensor([math.log(2.0), 0.0, -100.0])
    out = (kernel := make_kernel(pool)).forward(torch.zeros(1, 3, 2), None, None, layer, kernel.plan(md), save_kv_cache=False, sinks=sinks)
    torch.testing.assert_close(out[0], torch.tensor([[0.25, 0.25], [1 / 3, 1 / 3], [0.5, 0.5]]))


@KERNELS
def test_gqa_query_head_uses_kv_head_h_div_group(make_kernel) -> None:
    # 4 query heads over 2 kv heads: heads 0, 1 read kv head 0 (V = 1), heads 2, 3 read kv head 1 (V = 2).
    values = torch.tensor([1.0, 2.0]).view(1, 2, 1).expand(3, 2, 1).contiguous()
    pool, pages, _ = one_layer_pool(3, 2, 1, values)
    layer = LayerSpec(0, 4, 2, 2, 1, scaling=1.0)
    md = build_metadata(M.DECODE, kv_lens=[3], q_lens=[1], page_table=[pages], out_cache_loc=[2], pool=pool)
    out = (kernel := make_kernel(pool)).forward(torch.zeros(1, 4, 2), None, None, layer, kernel.plan(md), save_kv_cache=False)
    assert out[0, :, 0].tolist() == [1.0, 1.0, 2.0, 2.0]


@KERNELS
def test_scaling_multiplies_the_scores_hand_case(make_kernel) -> None:
    # K_0 = (1, 0), K_1 = (0, 0), q = (1, 0): scores (s, 0), so weight of key 0 is e^s / (e^s + 1).
    pool = CpuBackend().create_kv_pool(KVPoolSpec(1, 8, 4, 1, 2, 1))
    pool.set_kv(0, torch.tensor([4, 5]), torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]]]), torch.tensor([[[1.0]], [[0.0]]]))
    md = build_metadata(M.DECODE, kv_lens=[2], q_lens=[1], page_table=[[1]], out_cache_loc=[5], pool=pool)
    q = torch.tensor([[[1.0, 0.0]]])
    for s in (0.5, 2.0):
        out = (kernel := make_kernel(pool)).forward(q, None, None, LayerSpec(0, 1, 1, 2, 1, scaling=s), kernel.plan(md), save_kv_cache=False)
        assert float(out) == pytest.approx(math.exp(s) / (math.exp(s) + 1), rel=1e-6)


@KERNELS
def test_rows_that_see_no_key_are_zero(make_kernel) -> None:
    # paged_attention with kv_len < q_len (what a padded row with no keys looks like): request 0 has
    # one query at position -1 and no keys; request 1's first query (position -1) sees nothing either.
    pool = CpuBackend().create_kv_pool(KVPoolSpec(1, 8, 4, 1, 2, 1))
    pool.k_buffer(0).normal_()
    pool.v_buffer(0).fill_(5.0)
    q = torch.randn(3, 2, 2)
    for sinks in (None, torch.tensor([0.5, -0.5])):
        out = make_kernel.paged(
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
        torch.testing.assert_close(out[2].float(), expect)


@KERNELS
def test_empty_batch_returns_empty_output(make_kernel) -> None:
    pool = CpuBackend().create_kv_pool(KVPoolSpec(1, 8, 4, 1, 2, 3))
    md = build_metadata(M.DECODE, kv_lens=[], q_lens=[], page_table=[], out_cache_loc=[], pool=pool)
    empty = torch.zeros(0, 2, 2)
    out = (kernel := make_kernel(pool)).forward(empty, torch.zeros(0, 1, 2), torch.zeros(0, 1, 3), LayerSpec(0, 2, 1, 2, 3, 1.0), kernel.plan(md))
    assert out.shape == (0, 2, 3)


@st.composite
def dense_cases(draw: st.DrawFn):
    hkv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    dk, dv = draw(st.sampled_from([3, 8])), draw(st.sampled_from([2, 8]))
    kv_lens = draw(st.lists(st.integers(0, 12), min_size=0, max_size=3))
    q_lens = [draw(st.integers(0, n + 2)) for n in kv_lens]  # q_len > kv_len: rows that see nothing
    layer = LayerSpec(0, hkv * group, hkv, dk, dv, scaling=draw(st.floats(0.05, 1.0)),
                      sliding_window=draw(st.one_of(st.none(), st.integers(0, 5))), has_sinks=draw(st.booleans()))
    return layer, kv_lens, q_lens, draw(st.integers(0, 2**31 - 1))


@given(case=dense_cases())
def test_dense_attention_is_the_definition(case) -> None:
    layer, kv_lens, q_lens, seed = case
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, layer.num_kv_heads, layer.head_dim, generator=gen) for n in kv_lens]
    values = [torch.randn(n, layer.num_kv_heads, layer.v_head_dim, generator=gen) for n in kv_lens]
    q = torch.randn(sum(q_lens), layer.num_q_heads, layer.head_dim, generator=gen)
    sinks = torch.randn(layer.num_q_heads, generator=gen) * 2 if layer.has_sinks else None
    got = dense_attention(q, keys, values, q_lens, scaling=layer.scaling, sliding_window=layer.sliding_window, sinks=sinks)
    assert got.dtype == torch.float64
    expect = dense_loop_oracle(q, keys, values, q_lens, layer, sinks)
    if not kv_lens:
        assert got.shape[0] == 0
        return
    torch.testing.assert_close(got, expect, atol=1e-12, rtol=1e-12)


def test_paged_oracle_reads_only_each_requests_own_rows() -> None:
    """Pages hold NaN beyond each request's keys (a tail, a page another request used before): the
    oracle reads through the block table only the kv_len rows that are the request's."""
    ps, hkv, dk, dv = 4, 1, 2, 3
    k_cache = torch.full((6, ps, hkv, dk), float("nan"))
    v_cache = torch.full((6, ps, hkv, dv), float("inf"))
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(5, hkv, dk, generator=gen), torch.randn(2, hkv, dk, generator=gen)]
    values = [torch.randn(5, hkv, dv, generator=gen), torch.randn(2, hkv, dv, generator=gen)]
    table = [[4, 2], [5, 0]]
    for b, n in enumerate((5, 2)):
        for p in range(n):
            k_cache[table[b][p // ps], p % ps] = keys[b][p]
            v_cache[table[b][p // ps], p % ps] = values[b][p]
    q = torch.randn(3, 2, dk, generator=gen)
    out = paged_oracle(q, k_cache, v_cache, torch.tensor(table), torch.tensor([5, 2]), torch.tensor([0, 2, 3]),
                       scaling=0.7, sliding_window=2)
    expect = dense_attention(q, keys, values, [2, 1], scaling=0.7, sliding_window=2)
    assert torch.isfinite(out).all()
    assert torch.equal(out, expect)
