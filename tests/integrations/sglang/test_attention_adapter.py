"""The attention backend ``hal`` on real SGLang ForwardBatch objects, all four modes, against a
dense float64 oracle over the K/V each position was given.

The prefix K/V goes in through SGLang's own ``set_kv_buffer`` and the new tokens' K/V through the
hal backend: both land in the one copy of the KV, hal's pool, or the oracle disagrees.
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

import hal  # noqa: E402
from hal.errors import CacheLocationError, GraphError, SpecError, UnsupportedConfigError  # noqa: E402
from hal.integrations.sglang.plugin import bound_to  # noqa: E402
from hal.integrations.sglang.attention import HalAttnBackend  # noqa: E402
from hal.integrations.sglang.forward_batch import page_table_from_req_to_token  # noqa: E402
from hal.integrations.sglang.kv_pool import HalMHATokenToKVPool as UnboundHalPool  # noqa: E402
from hal.tree import chain_tree_mask, tree_mask_from_parents  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

from forward_batches import captured_by_hal_graphs, make_batch, replayed  # noqa: E402

# What hal's platform hands SGLang: the pool class bound to the backend it resolved.
HalMHATokenToKVPool = bound_to(UnboundHalPool, hal.get_backend("cpu"))

Q_HEADS, KV_HEADS, HEAD_DIM, V_HEAD_DIM = 4, 2, 16, 8
PAGE = 4
POOL_SLOTS = 512
MAX_REQS, MAX_CONTEXT = 8, 48


class World:
    """An SGLang pool and request table, the K/V every (request, position) holds, and the backend."""

    def __init__(self, pool_cls: type, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = pool_cls(
            size=POOL_SLOTS, page_size=PAGE, dtype=torch.float32, head_num=KV_HEADS, head_dim=HEAD_DIM,
            layer_num=2, device="cpu", enable_memory_saver=False, v_head_dim=V_HEAD_DIM,
        )
        self.req_to_token = torch.zeros((MAX_REQS, MAX_CONTEXT), dtype=torch.int32)
        # Each request gets its own pages, in a scrambled order (page 0 is padding).
        pages = (torch.randperm(POOL_SLOTS // PAGE - 1, generator=self.gen) + 1).tolist()
        per_req = MAX_CONTEXT // PAGE
        for r in range(MAX_REQS):
            mine = torch.tensor(pages[r * per_req : (r + 1) * per_req])
            self.req_to_token[r] = mine.repeat_interleave(PAGE) * PAGE + torch.arange(MAX_CONTEXT) % PAGE
        self.k = torch.randn((MAX_REQS, MAX_CONTEXT, KV_HEADS, HEAD_DIM), generator=self.gen, dtype=torch.float64)
        self.v = torch.randn((MAX_REQS, MAX_CONTEXT, KV_HEADS, V_HEAD_DIM), generator=self.gen, dtype=torch.float64)
        runner = types.SimpleNamespace(
            device="cpu",
            req_to_token_pool=types.SimpleNamespace(req_to_token=self.req_to_token),
            token_to_kv_pool=self.pool,
            model_config=types.SimpleNamespace(context_len=MAX_CONTEXT),
        )
        self.runner = runner
        self.backend = HalAttnBackend(runner, hal.get_backend("cpu"))

    def write_prefix(self, layer: RadixAttention, reqs: list[int], prefix: list[int]) -> None:
        """Positions ``0..prefix-1`` of each request, written by SGLang's own pool code."""
        for r, n in zip(reqs, prefix):
            if n:
                loc = self.req_to_token[r, :n].long()
                self.pool.set_kv_buffer(layer, loc, self.k[r, :n].float(), self.v[r, :n].float())


def oracle(q: torch.Tensor, world: World, reqs: list[int], q_lens: list[int], kv_lens: list[int], window: int | None) -> torch.Tensor:
    """Dense attention: row j of a request sits at position kv - q + j and sees keys
    max(0, p - window) .. p (all of 0..p without a window)."""
    out, row = [], 0
    group = Q_HEADS // KV_HEADS
    for r, ql, kl in zip(reqs, q_lens, kv_lens):
        k = world.k[r, :kl].repeat_interleave(group, dim=1)  # [kl, Hq, D]
        v = world.v[r, :kl].repeat_interleave(group, dim=1)
        for j in range(ql):
            p = kl - ql + j
            lo = 0 if window is None else max(0, p - window)
            scores = torch.einsum("hd,khd->hk", q[row].double(), k[lo : p + 1]) * HEAD_DIM**-0.5
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo : p + 1]))
            row += 1
    return torch.stack(out).reshape(row, Q_HEADS * V_HEAD_DIM)


CASES = [
    # mode, requests, prefix lengths, new tokens per request
    (ForwardMode.EXTEND, [0, 3, 5], [0, 6, 13], [9, 5, 1]),
    (ForwardMode.DECODE, [1, 2, 7], [4, 15, 30], [1, 1, 1]),
    (ForwardMode.TARGET_VERIFY, [2, 6], [7, 21], [4, 4]),
    (ForwardMode.DRAFT_EXTEND_V2, [4, 0, 1], [3, 9, 17], [3, 3, 3]),
]


@pytest.mark.parametrize("pool_cls", [HalMHATokenToKVPool, MHATokenToKVPool], ids=["hal-pool", "in-tree-pool"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize(("mode", "reqs", "prefix", "q_lens"), CASES, ids=[c[0].name for c in CASES])
def test_forward_matches_dense_oracle(pool_cls: type, window: int | None, mode: ForwardMode, reqs: list[int], prefix: list[int], q_lens: list[int]) -> None:
    world = World(pool_cls, seed=len(reqs) * 7 + sum(prefix))
    layer = RadixAttention(
        num_heads=Q_HEADS, head_dim=HEAD_DIM, scaling=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS, layer_id=1,
        v_head_dim=V_HEAD_DIM, sliding_window_size=-1 if window is None else window,
    )
    world.write_prefix(layer, reqs, prefix)
    fb = make_batch(mode, world, reqs, prefix, q_lens)
    world.backend.init_forward_metadata(fb)
    assert world.backend.forward_metadata.mode.name == mode.name
    kv = [p + q for p, q in zip(prefix, q_lens)]
    k_new = torch.cat([world.k[r, p:n] for r, p, n in zip(reqs, prefix, kv)]).float()
    v_new = torch.cat([world.v[r, p:n] for r, p, n in zip(reqs, prefix, kv)]).float()
    q = torch.randn((sum(q_lens), Q_HEADS, HEAD_DIM), generator=world.gen)
    forward = world.backend.forward_decode if mode == ForwardMode.DECODE else world.backend.forward_extend
    out = forward(q.reshape(len(q), -1), k_new.reshape(len(q), -1), v_new.reshape(len(q), -1), layer, fb)
    torch.testing.assert_close(out.double(), oracle(q, world, reqs, q_lens, kv, window), atol=1e-5, rtol=1e-5)
    # The new K/V is where SGLang reads it: its own buffer views show what hal wrote.
    loc = fb.out_cache_loc
    torch.testing.assert_close(world.pool.get_key_buffer(1)[loc], k_new)
    torch.testing.assert_close(world.pool.get_value_buffer(1)[loc], v_new)


def test_draft_extend_lengths_without_the_extend_fields() -> None:
    """SGLang's graph path gives DRAFT_EXTEND_V2 only seq_lens (after the write) and spec_info."""
    world = World(HalMHATokenToKVPool, seed=5)
    full = make_batch(ForwardMode.DRAFT_EXTEND_V2, world, [1, 2], [6, 11], [3, 3])
    world.backend.init_forward_metadata(full)
    expected = world.backend.forward_metadata
    full.extend_seq_lens_cpu = full.extend_prefix_lens_cpu = None
    world.backend.init_forward_metadata(full)
    got = world.backend.forward_metadata
    assert (got.q_lens_cpu, got.kv_lens_cpu) == (expected.q_lens_cpu, expected.kv_lens_cpu) == ((3, 3), (9, 14))
    assert torch.equal(got.block_table, expected.block_table)


def test_one_copy_of_the_kv() -> None:
    """SGLang's per-layer buffers are views of hal's pool: no second allocation."""
    world = World(MHATokenToKVPool, seed=1)
    hal_pool = world.backend.pool
    for i in range(2):
        assert world.pool.k_buffer[i].data_ptr() == hal_pool.k_buffer(i).data_ptr()
        assert world.pool.v_buffer[i].data_ptr() == hal_pool.v_buffer(i).data_ptr()
        assert world.pool.v_buffer[i].shape[-1] == V_HEAD_DIM
    assert world.pool.k_data_ptrs.tolist() == [hal_pool.k_buffer(i).data_ptr() for i in range(2)]


def test_a_graph_replay_runs_on_the_captured_tensors_holding_the_new_batch() -> None:
    """hal's graph backend replays a decode step captured on one batch for another: the layers
    run on the captured tensors, now holding the new batch's values, and compute its attention."""
    world = World(HalMHATokenToKVPool, seed=2)
    layer = RadixAttention(num_heads=Q_HEADS, head_dim=HEAD_DIM, scaling=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS, layer_id=1,
                           v_head_dim=V_HEAD_DIM)
    world.write_prefix(layer, [0, 1, 2, 3], [3, 5, 9, 20])
    q, k, v = torch.zeros(2, Q_HEADS * HEAD_DIM), torch.zeros(2, KV_HEADS * HEAD_DIM), torch.zeros(2, KV_HEADS * V_HEAD_DIM)
    seen = []

    def step() -> torch.Tensor:
        seen.append(world.backend.forward_metadata)
        return world.backend.forward_decode(q, k, v, layer, None)

    first = make_batch(ForwardMode.DECODE, world, [0, 1], [3, 5], [1, 1])
    graphs = captured_by_hal_graphs(world.backend, first, step, key="decode-2")
    captured = seen[-1].tensors()
    reqs, pos = [2, 3], [9, 20]
    new_q = torch.randn((2, Q_HEADS, HEAD_DIM), generator=world.gen)
    q.copy_(new_q.reshape(2, -1))  # what SGLang's runner does to its static inputs before a replay
    k.copy_(world.k[reqs, pos].reshape(2, -1))
    v.copy_(world.v[reqs, pos].reshape(2, -1))
    out = replayed(graphs, world.backend, make_batch(ForwardMode.DECODE, world, reqs, pos, [1, 1]), key="decode-2")
    record = seen[-1]
    assert all(record.tensors()[name] is tensor for name, tensor in captured.items())
    assert record.kv_lens_cpu == (10, 21) and record.kv_lens.tolist() == [10, 21]
    assert record.out_cache_loc.tolist() == world.req_to_token[reqs, pos].tolist()
    torch.testing.assert_close(out.double(), oracle(new_q, world, reqs, [1, 1], [10, 21], None), atol=1e-5, rtol=1e-5)
    assert world.backend.get_cuda_graph_seq_len_fill_value() == world.backend.kernel.seq_len_fill_value == 1
    # A verify batch of another width cannot reuse the tensors captured for its batch size.
    graphs = captured_by_hal_graphs(world.backend, make_batch(ForwardMode.TARGET_VERIFY, world, [0, 1], [3, 5], [2, 2]),
                                    lambda: seen.append(world.backend.forward_metadata), key="verify-2")
    before = seen[-1].positions.clone()
    with pytest.raises(GraphError, match="shape"):
        replayed(graphs, world.backend, make_batch(ForwardMode.TARGET_VERIFY, world, [0, 1], [3, 5], [3, 3]), key="verify-2")
    assert torch.equal(seen[-1].positions, before)


def test_a_graph_backend_that_is_not_hals_is_refused_at_its_first_capture_before_anything_is_written() -> None:
    """SGLang's own graph backends warm up and capture by calling the forward, without handing hal
    the record: hal's layers refuse to run rather than replay later on the captured batch's metadata."""
    world = World(HalMHATokenToKVPool, seed=2)
    layer = RadixAttention(num_heads=Q_HEADS, head_dim=HEAD_DIM, scaling=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS, layer_id=1,
                           v_head_dim=V_HEAD_DIM)
    world.backend.init_forward_metadata(make_batch(ForwardMode.DECODE, world, [0, 1], [3, 5], [1, 1]))  # an eager step before
    world.backend.init_forward_metadata_out_graph(make_batch(ForwardMode.DECODE, world, [0, 1], [3, 5], [1, 1]), in_capture=True)
    before = [t.clone() for t in world.pool.k_buffer + world.pool.v_buffer]
    with pytest.raises(UnsupportedConfigError, match="layer 1 runs with no metadata set up.*SGLANG_PLATFORM=hal"):
        world.backend.forward_decode(torch.ones(2, Q_HEADS * HEAD_DIM), torch.ones(2, KV_HEADS * HEAD_DIM),
                                     torch.ones(2, KV_HEADS * V_HEAD_DIM), layer, None)
    assert all(torch.equal(a, b) for a, b in zip(before, world.pool.k_buffer + world.pool.v_buffer))


def test_out_cache_loc_of_the_wrong_length_is_refused() -> None:
    world = World(HalMHATokenToKVPool, seed=6)
    fb = make_batch(ForwardMode.DECODE, world, [0, 1], [4, 7], [1, 1])
    fb.out_cache_loc = torch.cat([fb.out_cache_loc, torch.tensor([PAGE * 9])])
    with pytest.raises(SpecError, match=r"out_cache_loc has shape \(3,\), expected \(2,\)"):
        world.backend.init_forward_metadata(fb)


PARENTS = [-1, 0, 0, 1, 1, 2]  # node 0 the root; 1 and 2 its children; 3, 4 under 1; 5 under 2


def ngram_tree_verify(prefix: list[int], layout: str) -> object:
    """SGLang's NGRAM verify input over ``PARENTS`` for requests with these prefixes, its mask in
    SGLang's QLEN layout (``[N, N]`` per request, its CPU path) or FULL layout (``[N, prefix + N]``)."""
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    n = len(PARENTS)
    tree = tree_mask_from_parents([PARENTS])[0]
    masks = [tree.reshape(-1) if layout == "qlen" else torch.cat([torch.ones(n, p, dtype=torch.bool), tree], 1).reshape(-1)
             for p in prefix]
    depth = tree.sum(-1) - 1
    bs = len(prefix)
    return NgramVerifyInput(
        draft_token=torch.zeros(bs * n, dtype=torch.long), custom_mask=torch.cat(masks),
        positions=torch.cat([p + depth for p in prefix]), retrieve_index=torch.arange(bs * n).view(bs, n),
        retrieve_next_token=torch.full((bs, n), -1), retrieve_next_sibling=torch.full((bs, n), -1), draft_token_num=n,
    )


def eagle_verify(n: int, topk: int, custom_mask: torch.Tensor) -> object:
    """SGLang's EAGLE verify input with ``n`` draft tokens per request drafted with ``topk``."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    return EagleVerifyInput(
        draft_token=torch.zeros(n, dtype=torch.long), custom_mask=custom_mask, positions=torch.zeros(n, dtype=torch.long),
        retrieve_index=torch.zeros(1, n, dtype=torch.long), retrieve_next_token=torch.zeros(1, n, dtype=torch.long),
        retrieve_next_sibling=torch.zeros(1, n, dtype=torch.long), retrieve_cum_len=None, spec_steps=n - 1, topk=topk,
        draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=0, seq_lens_cpu=None,
    )


def tree_oracle(q: torch.Tensor, world: World, reqs: list[int], prefix: list[int], window: int | None) -> torch.Tensor:
    """Each verify row attends as the last row of a chain over its prefix and its own path
    (positions by depth, the window counting positions)."""
    n = len(PARENTS)
    tree = tree_mask_from_parents([PARENTS])[0]
    group = Q_HEADS // KV_HEADS
    out = []
    for b, (r, p) in enumerate(zip(reqs, prefix)):
        for i in range(n):
            path = tree[i].nonzero().flatten()
            keys = torch.cat([torch.arange(p), p + path])
            position = torch.cat([torch.arange(p), p + torch.arange(len(path))])
            if window is not None:
                keys = keys[position >= position[-1] - window]
            k = world.k[r, keys].repeat_interleave(group, dim=1)
            v = world.v[r, keys].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", q[b * n + i].double(), k) * HEAD_DIM**-0.5
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(out).reshape(len(out), Q_HEADS * V_HEAD_DIM)


@pytest.mark.parametrize("layout", ["qlen", "full"])
@pytest.mark.parametrize("window", [None, 1], ids=["full", "window1"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_an_ngram_tree_verify_attends_by_its_tree(layout: str, window: int | None, graph: bool) -> None:
    """NGRAM's verify trees branch: each row sees its prefix and its own ancestors, not its
    siblings' rows (which a chain's causal mask would show it)."""
    world = World(HalMHATokenToKVPool, seed=3)
    reqs, prefix, n = [0, 2], [5, 9], len(PARENTS)
    layer = RadixAttention(num_heads=Q_HEADS, head_dim=HEAD_DIM, scaling=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS, layer_id=1,
                           v_head_dim=V_HEAD_DIM, sliding_window_size=-1 if window is None else window)
    world.write_prefix(layer, reqs, prefix)
    fb = make_batch(ForwardMode.TARGET_VERIFY, world, reqs, prefix, [n, n])
    fb.spec_info = ngram_tree_verify(prefix, layout)
    k_new = torch.cat([world.k[r, p : p + n] for r, p in zip(reqs, prefix)]).float()
    v_new = torch.cat([world.v[r, p : p + n] for r, p in zip(reqs, prefix)]).float()
    q = torch.randn((2 * n, Q_HEADS, HEAD_DIM), generator=world.gen)

    def attend() -> torch.Tensor:
        return world.backend.forward_extend(q.reshape(2 * n, -1), k_new.reshape(2 * n, -1), v_new.reshape(2 * n, -1), layer, fb)

    if graph:  # captured on the batch (a placeholder tree), replayed on it (its tree)
        out = replayed(captured_by_hal_graphs(world.backend, fb, attend), world.backend, fb)
    else:
        world.backend.init_forward_metadata(fb)
        out = attend()
    md = world.backend.forward_metadata
    assert torch.equal(md.tree_mask, tree_mask_from_parents([PARENTS] * 2))
    assert md.positions.tolist() == fb.spec_info.positions.tolist()  # hal's positions by depth are SGLang's
    expect = tree_oracle(q, world, reqs, prefix, window)
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)
    chain = oracle(q, world, reqs, [n, n], [p + n for p in prefix], window)
    assert (chain - expect).abs().max() > 0.1  # the tree matters


def test_a_tree_verify_graph_is_captured_on_a_placeholder_chain_and_replays_each_batchs_tree() -> None:
    """SGLang captures a verify graph on placeholder inputs (an all-visible mask, of the size it
    allocates): the capture takes a chain of the batch's shape, each replay the batch's own tree."""
    world = World(HalMHATokenToKVPool, seed=4)
    n = len(PARENTS)
    capture = make_batch(ForwardMode.TARGET_VERIFY, world, [0, 1], [3, 4], [n, n])
    capture.spec_info = eagle_verify(n, topk=2, custom_mask=torch.ones(1000, dtype=torch.bool))
    seen = []
    graphs = captured_by_hal_graphs(world.backend, capture, lambda: seen.append(world.backend.forward_metadata))
    static = seen[-1].tensors()
    assert torch.equal(static["tree_mask"], chain_tree_mask(2, n))
    replay = make_batch(ForwardMode.TARGET_VERIFY, world, [2, 3], [7, 9], [n, n])
    replay.spec_info = ngram_tree_verify([7, 9], "qlen")
    replayed(graphs, world.backend, replay)
    md = seen[-1]
    assert md.tensors()["tree_mask"] is static["tree_mask"]  # the captured tensor, now holding the batch's trees
    assert torch.equal(md.tree_mask, tree_mask_from_parents([PARENTS] * 2))


def test_a_tree_mask_that_hides_the_prefix_or_is_no_tree_is_refused_before_anything_is_written() -> None:
    world = World(HalMHATokenToKVPool, seed=3)
    fb = make_batch(ForwardMode.TARGET_VERIFY, world, [0], [5], [6])
    before = [t.clone() for t in world.pool.k_buffer]
    fb.spec_info = ngram_tree_verify([5], "full")
    fb.spec_info.custom_mask[11 * 2 + 3] = False  # row 2 hides prefix key 3
    with pytest.raises(SpecError, match="request 0 row 2 hides prefix key 3"):
        world.backend.init_forward_metadata(fb)
    fb.spec_info = ngram_tree_verify([5], "qlen")
    fb.spec_info.custom_mask[6 * 4 + 2] = True  # row 4 also sees row 2, its parent's sibling
    with pytest.raises(SpecError, match=r"row 4 sees rows \[0, 1, 2, 4\], but its parent row 2 sees \[0, 2\]"):
        world.backend.init_forward_metadata(fb)
    fb.spec_info = ngram_tree_verify([5], "qlen")
    fb.spec_info.custom_mask = fb.spec_info.custom_mask[:-1]
    with pytest.raises(SpecError, match="custom_mask of 35 entries; expected 36"):
        world.backend.init_forward_metadata(fb)
    fb.spec_info = ngram_tree_verify([5], "qlen")
    fb.spec_info.custom_mask = fb.spec_info.custom_mask.to(torch.uint8)
    with pytest.raises(UnsupportedConfigError, match="bit-packed"):
        world.backend.init_forward_metadata(fb)
    assert world.backend.forward_metadata is None
    assert all(torch.equal(a, b) for a, b in zip(before, world.pool.k_buffer))


def test_an_eagle_tree_is_served_by_its_mask_and_an_eagle_chain_by_its_topk() -> None:
    world = World(HalMHATokenToKVPool, seed=3)
    fb = make_batch(ForwardMode.TARGET_VERIFY, world, [0], [5], [4])
    tree = tree_mask_from_parents([[-1, 0, 0, 1]])
    fb.spec_info = eagle_verify(4, topk=2, custom_mask=torch.cat([torch.ones(4, 5, dtype=torch.bool), tree[0]], 1).reshape(-1))
    world.backend.init_forward_metadata(fb)
    assert torch.equal(world.backend.forward_metadata.tree_mask, tree)
    # A chain carries a custom mask too (all visible, as SGLang's own chain verify builds it).
    fb.spec_info = eagle_verify(4, topk=1, custom_mask=torch.ones(5 * 4 + 16, dtype=torch.bool))
    world.backend.init_forward_metadata(fb)
    md = world.backend.forward_metadata
    assert md.tree_mask is None and md.q_lens_cpu == (4,) and md.kv_lens_cpu == (9,)


def test_a_verify_input_that_does_not_say_its_shape_is_refused() -> None:
    world = World(HalMHATokenToKVPool, seed=3)
    fb = make_batch(ForwardMode.TARGET_VERIFY, world, [0], [5], [4])
    fb.spec_info = types.SimpleNamespace(num_tokens_per_req=4, draft_token_num=4)
    with pytest.raises(UnsupportedConfigError, match="does not say its tree's branching"):
        world.backend.init_forward_metadata(fb)


def test_rows_that_are_not_whole_pages_are_refused() -> None:
    rows = (torch.tensor([[8, 9, 10, 11, 20, 22, 21, 23]]))
    with pytest.raises(CacheLocationError, match="position 5 at slot 22"):
        page_table_from_req_to_token(rows, [8], 4)
    assert page_table_from_req_to_token(rows[:, :5], [5], 4).tolist() == [[2, 5]]


def test_a_padded_request_reads_the_padding_page_and_a_stray_padding_slot_is_refused() -> None:
    """A graph batch's padded requests (and the batch a graph is captured on) keep every position
    at slot 0: they read the padding page. A real request with one position at slot 0 is refused."""
    rows = torch.tensor([[8, 9, 10, 11, 20, 21], [0, 0, 0, 0, 0, 0]])
    assert page_table_from_req_to_token(rows, [6, 5], 4).tolist() == [[2, 5], [0, 0]]
    with pytest.raises(CacheLocationError, match="request 0 keeps position 5 at slot 0"):
        page_table_from_req_to_token(torch.tensor([[8, 9, 10, 11, 20, 0]]), [6], 4)


def test_a_bad_slot_is_refused_before_anything_is_written() -> None:
    world = World(HalMHATokenToKVPool, seed=4)
    layer = RadixAttention(num_heads=Q_HEADS, head_dim=HEAD_DIM, scaling=0.25, num_kv_heads=KV_HEADS, layer_id=0, v_head_dim=V_HEAD_DIM)
    fb = make_batch(ForwardMode.EXTEND, world, [0], [0], [2])
    fb.out_cache_loc = torch.tensor([4, POOL_SLOTS + 2 * PAGE])
    before = [t.clone() for t in world.pool.k_buffer]
    with pytest.raises(CacheLocationError, match=str(POOL_SLOTS + 2 * PAGE)):
        world.backend.init_forward_metadata(fb)
        world.backend.forward_extend(torch.zeros(2, Q_HEADS * HEAD_DIM), torch.ones(2, KV_HEADS * HEAD_DIM), torch.ones(2, KV_HEADS * V_HEAD_DIM), layer, fb)
    assert all(torch.equal(a, b) for a, b in zip(before, world.pool.k_buffer))


def _fuzz_cases(world: World, n: int) -> dict[str, tuple[ForwardBatch, type[Exception], str]]:
    """One bad ForwardBatch per kind, the error class it must raise and what the message names."""
    def extend() -> ForwardBatch:
        return make_batch(ForwardMode.EXTEND, world, [0, 3], [4, 9], [3, 2])

    negative, oversized, short, past = extend(), extend(), extend(), extend()
    negative.out_cache_loc = negative.out_cache_loc.clone()
    negative.out_cache_loc[1] = -1 - n
    oversized.out_cache_loc = oversized.out_cache_loc.clone()
    oversized.out_cache_loc[1] = POOL_SLOTS + PAGE * (1 + n)
    short.seq_lens_cpu = torch.tensor([4 + 3, 1 + n % 2])  # request 1: fewer keys than new rows
    short.extend_seq_lens_cpu = [3, 3 + n % 2]
    past.req_pool_indices = torch.tensor([0, MAX_REQS + n])
    return {
        "negative out_cache_loc": (negative, SpecError, f"negative slot {-1 - n}"),
        "oversized out_cache_loc": (oversized, CacheLocationError, f"cache location {POOL_SLOTS + PAGE * (1 + n)}"),
        "seq_lens shorter than extend_seq_lens": (short, SpecError, "need 0 <= q_len <= kv_len"),
        "req_pool_indices row past the pool": (past, SpecError, f"req_pool_indices [{MAX_REQS + n}] outside the request table's rows 0..{MAX_REQS - 1}"),
    }


def test_fuzz_bad_forward_batches_are_refused_before_any_write() -> None:
    """Bad ForwardBatch fields, with hypothesis drawing the values: each is a typed error that names
    the value, on the eager and the graph path, and the KV is unchanged."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    world = World(HalMHATokenToKVPool, seed=8)
    layer = RadixAttention(num_heads=Q_HEADS, head_dim=HEAD_DIM, scaling=0.25, num_kv_heads=KV_HEADS, layer_id=0, v_head_dim=V_HEAD_DIM)

    @settings(max_examples=24, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(kind=st.sampled_from(sorted(_fuzz_cases(world, 0))), n=st.integers(0, 40), graph=st.booleans())
    def check(kind: str, n: int, graph: bool) -> None:
        fb, error, names = _fuzz_cases(world, n)[kind]
        before = [t.clone() for t in world.pool.k_buffer + world.pool.v_buffer]
        rows = int(sum(fb.extend_seq_lens_cpu))
        with pytest.raises(error) as info:
            def attend() -> torch.Tensor:
                return world.backend.forward_extend(torch.zeros(rows, Q_HEADS * HEAD_DIM), torch.ones(rows, KV_HEADS * HEAD_DIM),
                                                    torch.ones(rows, KV_HEADS * V_HEAD_DIM), layer, fb)  # fmt: skip

            if graph:
                captured_by_hal_graphs(world.backend, fb, attend)
            else:
                world.backend.init_forward_metadata(fb)
                attend()
        assert names in str(info.value), (kind, str(info.value))
        assert all(torch.equal(a, b) for a, b in zip(before, world.pool.k_buffer + world.pool.v_buffer)), kind

    check()


def test_the_adapter_takes_the_backend_the_edge_resolved_and_looks_none_up() -> None:
    """No fallback lookup inside: an unbound pool class and a missing backend are refused by name."""
    with pytest.raises(UnsupportedConfigError, match="SGLANG_PLATFORM=hal"):
        World(UnboundHalPool, seed=1)
    world = World(MHATokenToKVPool, seed=1)
    with pytest.raises(UnsupportedConfigError, match="backend must be a hal.Backend"):
        HalAttnBackend(world.runner, "cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("topk", [1, 2])
def test_multi_step_draft_decode_branches_see_the_prefix_and_their_own_drafts(topk: int) -> None:
    """EAGLE's multi-step draft decode with pages of 4 tokens, laid out as SGLang's
    ``prepare_for_draft`` lays it out (with ``topk > 1`` each branch owns whole pages from the
    prefix's last full page on, its first slots a copy of the prefix's tail): at step ``s`` branch
    ``j`` of a request sees the prefix and its own drafts ``0..s``, against a dense oracle."""
    from hal.integrations.sglang.draft import HalMultiStepDraftBackend

    steps, reqs, seq_lens = 3, [1, 6], [6, 9]
    world = World(HalMHATokenToKVPool, seed=11 + topk)
    layer = RadixAttention(num_heads=Q_HEADS, head_dim=HEAD_DIM, scaling=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS, layer_id=1,
                           v_head_dim=V_HEAD_DIM)
    world.write_prefix(layer, reqs, seq_lens)
    draft_k = torch.randn((len(reqs), topk, steps, KV_HEADS, HEAD_DIM), generator=world.gen, dtype=torch.float64)
    draft_v = torch.randn((len(reqs), topk, steps, KV_HEADS, V_HEAD_DIM), generator=world.gen, dtype=torch.float64)
    slots = torch.zeros((len(reqs), topk, steps), dtype=torch.int64)
    for b, (r, n) in enumerate(zip(reqs, seq_lens)):
        tail = n % PAGE if topk > 1 else 0
        pages_per_branch = -(-(tail + steps) // PAGE) if topk > 1 else 0
        for j in range(topk):
            start = n - tail + j * pages_per_branch * PAGE
            copy = world.req_to_token[r, start : start + tail].long()  # the prefix tail's copy in this branch's page
            world.pool.set_kv_buffer(layer, copy, world.k[r, n - tail : n].float(), world.v[r, n - tail : n].float())
            slots[b, j] = world.req_to_token[r, start + tail : start + tail + steps]
    backend = HalMultiStepDraftBackend(world.runner, hal.get_backend("cpu"), topk, steps)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor(seq_lens), seq_lens_cpu=torch.tensor(seq_lens),
                                  req_pool_indices=torch.tensor(reqs), out_cache_loc=slots.reshape(-1))
    backend.init_forward_metadata(batch)
    group = Q_HEADS // KV_HEADS
    for step, child in enumerate(backend.attn_backends):
        q = torch.randn((len(reqs) * topk, Q_HEADS, HEAD_DIM), generator=world.gen)
        k_new, v_new = draft_k[:, :, step].reshape(-1, KV_HEADS * HEAD_DIM), draft_v[:, :, step].reshape(-1, KV_HEADS * V_HEAD_DIM)
        out = child.forward_decode(q.reshape(len(q), -1), k_new.float(), v_new.float(), layer, batch)
        expected = []
        for b, (r, n) in enumerate(zip(reqs, seq_lens)):
            for j in range(topk):
                k = torch.cat([world.k[r, :n], draft_k[b, j, : step + 1]]).repeat_interleave(group, dim=1)
                v = torch.cat([world.v[r, :n], draft_v[b, j, : step + 1]]).repeat_interleave(group, dim=1)
                scores = torch.einsum("hd,khd->hk", q[b * topk + j].double(), k) * HEAD_DIM**-0.5
                expected.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v).reshape(-1))
        torch.testing.assert_close(out.double(), torch.stack(expected), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(world.pool.get_key_buffer(1)[slots[:, :, step].reshape(-1)], k_new.float().reshape(-1, KV_HEADS, HEAD_DIM))
    short = types.SimpleNamespace(**{**vars(batch), "out_cache_loc": slots.reshape(-1)[1:]})
    with pytest.raises(SpecError, match="out_cache_loc"):
        backend.init_forward_metadata(short)
