"""The Triton paged-attention kernel against the oracle, run here in the Triton interpreter.

``hal.get_backend("cuda", emulate=True)`` sets ``TRITON_INTERPRET=1`` before the kernel module
(and triton) is imported, so the very kernels a GPU runs execute on CPU tensors.
"""

from __future__ import annotations

import random

import pytest
import torch

import hal
from hal.backends.cpu import CpuBackend
from hal.allocator import KVAllocator, RequestPageTable
from hal.errors import KVLayoutError, SpecError, UnsupportedConfigError
from hal.metadata import build_metadata
from hal.tools.testing import AttentionCase, prepare_case, run_attention_case, standard_attention_cases
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec
from hal.tools.conformance import tree_cases

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(scope="module")
def cuda() -> hal.Backend:
    return hal.get_backend("cuda", emulate=True)


def _standard_cases() -> list[AttentionCase]:
    # Every mode x (plain, sinks, SWA, SWA + sinks in a hybrid pool) x the axes below.
    cases = standard_attention_cases(
        dtypes=(F32,), page_sizes=(16, 64), head_dims=((64, 32), (64, 64), (192, 128), (48, 40)), heads=((4, 1), (4, 4))
    )
    cases += standard_attention_cases(dtypes=(F32,), head_dims=((64, 32),), heads=((8, 1), (6, 2)), seed=1000)
    cases += standard_attention_cases(dtypes=(F16,), head_dims=((64, 32), (48, 40)), heads=((4, 1), (6, 2)), seed=2000)
    # bf16 loads/stores here (tiles are upcast before tl.dot in the interpreter); the native bf16
    # tl.dot path runs in benchmarks/cuda_check.py on a GPU.
    cases += standard_attention_cases(dtypes=(BF16,), page_sizes=(64,), head_dims=((48, 40),), heads=((4, 1),), seed=3000)
    return cases


def _layer(hq: int, hkv: int, dk: int, dv: int, *, window: int | None = None, sinks: bool = False, scaling: float | None = None) -> LayerSpec:
    return LayerSpec(0, hq, hkv, dk, dv, scaling=dk**-0.5 if scaling is None else scaling, sliding_window=window, has_sinks=sinks)


def _edge_cases() -> list[AttentionCase]:
    rng = random.Random(7)
    decode_kv = tuple(rng.randint(1, 90) for _ in range(20))
    E, D, V, X = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2
    return [
        # A request with no new tokens and an empty request between real ones.
        AttentionCase(E, _layer(4, 2, 32, 32), (17, 0, 12, 9), (5, 0, 0, 9), seed=1),
        # Window 0: each token sees only itself; a window wider than every sequence is full attention.
        AttentionCase(E, _layer(4, 1, 32, 16, window=0), (40, 9), (7, 9), seed=2),
        AttentionCase(V, _layer(4, 1, 32, 16, window=0, sinks=True), (23, 30), (4, 4), seed=3),
        AttentionCase(E, _layer(4, 1, 32, 16, window=1000, sinks=True), (45, 20), (12, 20), seed=4),
        # Long prefix, window start in the middle of a K/V tile, many tiles.
        AttentionCase(E, _layer(2, 1, 64, 64, window=40), (300,), (70,), seed=5),
        AttentionCase(D, _layer(2, 1, 64, 64, window=40, sinks=True), (300, 41, 2), (1, 1, 1), page_size=64, hybrid=True, seed=6),
        # Many requests: the program -> request binary search.
        AttentionCase(D, _layer(4, 2, 32, 32, sinks=True), decode_kv, (1,) * 20, seed=7),
        AttentionCase(X, _layer(4, 2, 32, 32), decode_kv[:9], (3,) * 9, seed=8),
        # A GQA group wider than the minimum tile, alone in its tile.
        AttentionCase(D, _layer(32, 1, 32, 32, sinks=True), (70, 3), (1, 1), seed=9),
        AttentionCase(E, _layer(32, 1, 32, 32, window=9), (50, 17), (20, 17), seed=10),
        # Head dims below the 16-wide minimum tile, non-power-of-two group, non-default scale.
        AttentionCase(V, _layer(6, 2, 8, 24, scaling=0.3), (33, 18), (5, 5), seed=11),
        AttentionCase(E, _layer(3, 3, 20, 12, window=3, sinks=True), (29, 64), (29, 3), page_size=64, dtype=F16, seed=12),
        # MiMo-V2-like dims on a hybrid pool, fp16.
        AttentionCase(X, _layer(8, 2, 192, 128, window=7, sinks=True), (64, 90), (4, 4), page_size=64, dtype=F16, hybrid=True, seed=13),
    ]


STANDARD = _standard_cases()
EDGE = _edge_cases()


def test_case_matrix_covers_every_mode_and_feature() -> None:
    cases = STANDARD + EDGE
    assert {c.mode for c in cases} == {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2}
    assert {c.page_size for c in cases} == {16, 64}
    assert {c.dtype for c in cases} == {F32, F16, BF16}
    assert any(c.layer.head_dim != c.layer.v_head_dim and c.layer.head_dim & (c.layer.head_dim - 1) for c in cases)
    assert any(c.layer.group_size > 1 for c in cases) and any(c.hybrid for c in cases)
    assert any(c.layer.has_sinks and c.layer.sliding_window is not None for c in cases)


@pytest.mark.parametrize("case", STANDARD + EDGE, ids=lambda c: c.describe())
def test_matches_cpu_reference(cuda: hal.Backend, case: AttentionCase) -> None:
    result = run_attention_case(cuda, case)  # compares the output and the K/V written to the pool
    assert result.passed, result.detail


TREES = tree_cases(quick=True)


@pytest.mark.parametrize("case", TREES, ids=lambda c: c.describe())
def test_tree_verify_matches_the_oracle(cuda: hal.Backend, case: AttentionCase) -> None:
    result = run_attention_case(cuda, case)
    assert result.passed, result.detail


def test_save_kv_cache_false_reads_the_cache_and_writes_nothing(cuda: hal.Backend) -> None:
    case = AttentionCase(ForwardMode.TARGET_VERIFY, _layer(4, 2, 32, 16, window=6, sinks=True), (30, 21), (4, 4), seed=21)
    got, ref = prepare_case(cuda, case)
    lay = case.layer
    # Put the new tokens' K/V in both caches first, then run without saving.
    for p in (got, ref):
        p.pool.set_kv(0, p.metadata.out_cache_loc, p.k, p.v)
    before = got.pool.k_buffer(0).clone(), got.pool.v_buffer(0).clone()
    garbage_k, garbage_v = torch.full_like(got.k, 9.0), torch.full_like(got.v, 9.0)
    out = got.kernel.forward(got.q, garbage_k, garbage_v, lay, got.kernel.plan(got.metadata), save_kv_cache=False, sinks=got.sinks)
    expect = ref.kernel.forward(ref.q, ref.k, ref.v, lay, ref.kernel.plan(ref.metadata), save_kv_cache=False, sinks=ref.sinks)
    assert torch.equal(got.pool.k_buffer(0), before[0]) and torch.equal(got.pool.v_buffer(0), before[1])
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)


def test_bad_calls_raise_typed_errors_and_leave_the_pool_unchanged(cuda: hal.Backend) -> None:
    case = AttentionCase(ForwardMode.DECODE, _layer(4, 2, 32, 16, sinks=True), (9, 20), (1, 1), seed=22)
    got, _ = prepare_case(cuda, case)
    lay, md = case.layer, got.metadata
    before = got.pool.k_buffer(0).clone()
    with pytest.raises(SpecError, match=r"v has shape \(2, 2, 32\), expected \(2, 2, 16\)"):
        got.kernel.forward(got.q, got.k, got.k, lay, got.kernel.plan(md), sinks=got.sinks)
    with pytest.raises(SpecError, match="has_sinks=True but sinks were not given"):
        got.kernel.forward(got.q, got.k, got.v, lay, got.kernel.plan(md))
    with pytest.raises(KVLayoutError, match="q has dtype torch.float16"):
        got.kernel.forward(got.q.half(), got.k, got.v, lay, got.kernel.plan(md), sinks=got.sinks)
    assert torch.equal(got.pool.k_buffer(0), before)


def test_head_dim_above_the_kernel_limit_is_refused_before_writing(cuda: hal.Backend) -> None:
    lay = _layer(2, 1, 320, 64)
    pool = cuda.create_kv_pool(KVPoolSpec(1, 32, 16, 1, 320, 64))
    md = build_metadata(ForwardMode.DECODE, kv_lens=[3], q_lens=[1], page_table=[[1]], out_cache_loc=[18], pool=pool)
    q, k, v = torch.ones(1, 2, 320), torch.ones(1, 1, 320), torch.ones(1, 1, 64)
    with pytest.raises(UnsupportedConfigError, match="head_dim=320"):
        (attn := cuda.create_attention(pool)).forward(q, k, v, lay, attn.plan(md))
    assert not pool.k_buffer(0).any()


def _filled_pools(backends: list[hal.Backend], spec: KVPoolSpec, prefix_lens: list[int], max_len: int, seed: int):
    """Identical pools (same pages, same prefix K/V) on each backend."""
    gen = torch.Generator().manual_seed(seed)
    heads, dk, dv = spec.layer_dims(0)
    prefix = [(torch.randn(n, heads, dk, generator=gen), torch.randn(n, heads, dv, generator=gen)) for n in prefix_lens]
    out = []
    for be in backends:
        pool = be.create_kv_pool(spec)
        table = RequestPageTable(KVAllocator(pool))
        for r, (k, v) in enumerate(prefix):
            table.reserve(r, max_len)
            pool.set_kv(0, table.slots(r, range(k.shape[0])), k, v)
        out.append((pool, table))
    return out


@pytest.mark.parametrize("mode, tokens", [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 3)])
def test_graph_runner_replays_match_eager_reference(cuda: hal.Backend, mode: ForwardMode, tokens: int) -> None:
    """Replays feed the kernel refreshed device metadata and stale host metadata, as a CUDA graph does."""
    lay = _layer(4, 2, 48, 40, window=11, sinks=True)
    spec = KVPoolSpec(1, 16 * 40, 16, 2, 48, 40)
    lens = [5, 30, 17, 44, 2, 61]
    max_pages = 6
    (pool, table), (ref_pool, ref_table) = _filled_pools([cuda, CpuBackend()], spec, lens, max_pages * 16, seed=31)
    attn, ref_attn = cuda.create_attention(pool), CpuBackend().create_attention(ref_pool)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3))

    def forward(inputs, md):
        return attn.forward(inputs["q"], inputs["k"], inputs["v"], lay, attn.plan(md), sinks=sinks)

    runner = hal.GraphRunner(
        cuda,
        forward,
        attention=attn,
        mode=mode,
        tokens_per_request=tokens,
        batch_sizes=[1, 2, 4],
        max_pages_per_request=max_pages,
        inputs={"q": ((4, 48), torch.float32), "k": ((2, 48), torch.float32), "v": ((2, 40), torch.float32)},
    )
    runner.capture()
    gen = torch.Generator().manual_seed(5)
    # Batches that pad (3 -> 4), fit exactly, shrink, and overflow into the eager fallback.
    for step, requests in enumerate([[0, 1, 2], [3, 4], [5], [1, 3, 4, 5], [0, 1, 2, 3, 4, 5]]):
        t = len(requests) * tokens
        inputs = {"q": torch.randn(t, 4, 48, generator=gen), "k": torch.randn(t, 2, 48, generator=gen), "v": torch.randn(t, 2, 40, generator=gen)}
        mds = []
        for tab, p in ((table, pool), (ref_table, ref_pool)):
            kv = [lens[r] + tokens for r in requests]
            loc = torch.cat([tab.slots(r, range(lens[r], lens[r] + tokens)) for r in requests])
            mds.append(build_metadata(mode, kv_lens=kv, q_lens=[tokens] * len(requests), page_table=tab.table(requests), out_cache_loc=loc, pool=p))
        out = runner.run(inputs, mds[0]).clone()
        expect = ref_attn.forward(inputs["q"], inputs["k"], inputs["v"], lay, ref_attn.plan(mds[1]), sinks=sinks)
        torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5, msg=lambda m: f"step {step}: {m}")
        for r in requests:
            lens[r] += tokens
    # Padded rows write only the padding page; every real page matches the reference.
    assert torch.equal(pool.k_buffer(0)[1:], ref_pool.k_buffer(0)[1:])
    assert torch.equal(pool.v_buffer(0)[1:], ref_pool.v_buffer(0)[1:])


def test_split_count_rule(cuda: hal.Backend) -> None:
    from hal.backends.cuda.triton_attention import MAX_SPLITS, split_count

    assert split_count(programs=264, capacity=32768, block_n=32, sm_count=132) == 1  # the grid fills the GPU
    assert split_count(programs=8, capacity=32768, block_n=32, sm_count=132) == MAX_SPLITS  # 8 x 32 < 264, capped
    assert split_count(programs=8, capacity=1024, block_n=32, sm_count=132) == 4  # keeps >= 256 keys per split
    assert split_count(programs=66, capacity=32768, block_n=32, sm_count=132) == 4  # 66 x 4 >= 2 x 132
    assert split_count(programs=8, capacity=300, block_n=32, sm_count=132) == 1  # too few keys to split


@pytest.mark.parametrize("num_splits", [None, 2, 8])
@pytest.mark.parametrize("q_len, window, sinks", [(1, None, False), (1, 9, True), (3, None, True), (3, 20, False)])
def test_split_kv_matches_the_oracle(cuda: hal.Backend, num_splits: int | None, q_len: int, window: int | None, sinks: bool) -> None:
    """Split-KV (flash decoding) on decode- and verify-shaped batches: requests whose keys fill every
    split, a few, or one (empty splits merge as nothing), with windows and sinks; ``None`` is the
    default dispatch, which splits this small grid (2 requests x 2 kv heads) 4 ways."""
    from hal.backends.cuda.triton_attention import paged_attention as triton_paged
    from hal.oracle import paged_oracle

    gen = torch.Generator().manual_seed(q_len * 10 + (window or 0))
    ps, hkv, hq, dk, dv, pages = 16, 2, 8, 24, 20, 64
    k_cache, v_cache = torch.randn(pages + 1, ps, hkv, dk, generator=gen), torch.randn(pages + 1, ps, hkv, dv, generator=gen)
    kv_lens = torch.tensor([1000, q_len + 2], dtype=torch.int32)
    table = torch.zeros(2, 64, dtype=torch.int32)
    table[0] = torch.randperm(pages, generator=gen)[:64] + 1
    table[1, :1] = 7
    cu = torch.arange(3, dtype=torch.int32) * q_len
    q = torch.randn(2 * q_len, hq, dk, generator=gen)
    sink = torch.randn(hq, generator=gen) if sinks else None
    args = (q, k_cache, v_cache, table, kv_lens, cu)
    got = triton_paged(*args, scaling=0.2, sliding_window=window, sinks=sink, query_rows_hint=q_len, num_splits=num_splits)
    expect = paged_oracle(*args, scaling=0.2, sliding_window=window, sinks=sink)
    torch.testing.assert_close(got.double(), expect, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window, sinks", [(None, False), (2, True)])
def test_split_kv_over_a_tree_matches_the_oracle(cuda: hal.Backend, num_splits: int, window: int | None, sinks: bool) -> None:
    """Tree verify with split-KV: each split masks its keys by the tree and the rows' depths."""
    from hal.backends.cuda.triton_attention import paged_attention as triton_paged
    from hal.oracle import paged_oracle
    from hal.tree import tree_mask_from_parents

    gen = torch.Generator().manual_seed(11)
    ps, hkv, hq, dk, dv, pages = 16, 2, 4, 24, 20, 64
    k_cache, v_cache = torch.randn(pages + 1, ps, hkv, dk, generator=gen), torch.randn(pages + 1, ps, hkv, dv, generator=gen)
    parents = [[-1, 0, 0, 1, 2, 2], [-1, 0, 1, 1, 3, 0]]
    n = len(parents[0])
    kv_lens = torch.tensor([1000, n + 3], dtype=torch.int32)
    table = torch.zeros(2, 64, dtype=torch.int32)
    table[0] = torch.randperm(pages, generator=gen)[:64] + 1
    table[1, :1] = 9
    cu = torch.arange(3, dtype=torch.int32) * n
    q = torch.randn(2 * n, hq, dk, generator=gen)
    sink = torch.randn(hq, generator=gen) if sinks else None
    tree = tree_mask_from_parents(parents)
    args = (q, k_cache, v_cache, table, kv_lens, cu)
    got = triton_paged(*args, scaling=0.2, sliding_window=window, sinks=sink, query_rows_hint=n, num_splits=num_splits,
                       tree_mask=tree)
    expect = paged_oracle(*args, scaling=0.2, sliding_window=window, sinks=sink, tree_mask=tree)
    torch.testing.assert_close(got.double(), expect, atol=2e-5, rtol=2e-5)
    chain = paged_oracle(*args, scaling=0.2, sliding_window=window, sinks=sink)
    assert (chain - expect).abs().max() > 0.1  # the tree matters


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_nan_key_reaches_exactly_the_rows_that_see_it_with_and_without_split_kv(cuda: hal.Backend, num_splits: int) -> None:
    """A verify block of 3 rows whose second key is NaN: the first row (which does not see it) is
    the oracle's, the two after it are NaN, as the oracle's are (never a finite stand-in)."""
    from hal.backends.cuda.triton_attention import paged_attention as triton_paged
    from hal.oracle import paged_oracle

    gen = torch.Generator().manual_seed(5)
    ps, hkv, hq, dk, dv, pages = 16, 2, 4, 24, 20, 64
    k_cache, v_cache = torch.randn(pages + 1, ps, hkv, dk, generator=gen), torch.randn(pages + 1, ps, hkv, dv, generator=gen)
    kv_lens = torch.tensor([1000], dtype=torch.int32)
    table = (torch.randperm(pages, generator=gen)[:64] + 1).to(torch.int32)[None]
    position = 1000 - 3 + 1  # the block's second row
    k_cache[table[0, position // ps], position % ps] = float("nan")
    q = torch.randn(3, hq, dk, generator=gen)
    args = (q, k_cache, v_cache, table, kv_lens, torch.tensor([0, 3], dtype=torch.int32))
    got = triton_paged(*args, scaling=0.2, sliding_window=None, sinks=None, query_rows_hint=3, num_splits=num_splits)
    expect = paged_oracle(*args, scaling=0.2, sliding_window=None, sinks=None)
    assert expect[0].isfinite().all() and expect[1:].isnan().all()
    torch.testing.assert_close(got.double(), expect, atol=2e-5, rtol=2e-5, equal_nan=True)
