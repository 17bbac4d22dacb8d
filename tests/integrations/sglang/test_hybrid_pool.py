"""SGLang's hybrid sliding-window pool (``SWAKVPool``, as MiMo-V2-Flash is served) stored in one hybrid
hal pool: real ForwardBatch objects in all four modes against a dense float64 oracle with the
window and per-head sinks, SWA pages that SGLang freed outside the window, and the refusals.

Full layers keep 1 kv head, sliding-window layers 2 (as MiMo-V2-Flash doubles them), in a smaller
SWA sub-pool. SGLang maps full slots to SWA slots one by one (``full_to_swa_index_mapping``);
pages before a request's window are freed (mapped to 0) and their SWA pages handed to other pages.
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

import hal  # noqa: E402
from hal.errors import CacheLocationError, UnsupportedConfigError  # noqa: E402
from hal.integrations.sglang.plugin import bound_to  # noqa: E402
from hal.integrations.sglang.attention import HalAttnBackend  # noqa: E402
from hal.integrations.sglang.kv_pool import HalMHATokenToKVPool as UnboundHalPool, store_in_hal_pool  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from forward_batches import captured_by_hal_graphs, make_batch, replayed  # noqa: E402

# What hal's platform hands SGLang: the pool class bound to the backend it resolved.
HalMHATokenToKVPool = bound_to(UnboundHalPool, hal.get_backend("cpu"))

Q_HEADS, HEAD_DIM, V_HEAD_DIM = 4, 16, 8
KV_HEADS = {False: 1, True: 2}  # by is_swa
WINDOW = 5
PAGE = 4
FULL_SLOTS, SWA_SLOTS = 512, 256
MAX_REQS, MAX_CONTEXT = 8, 48
FULL_IDS, SWA_IDS = [0, 3], [1, 2]


def make_pool(pool_cls: type) -> SWAKVPool:
    return SWAKVPool(
        size=FULL_SLOTS, size_swa=SWA_SLOTS, page_size=PAGE, dtype=torch.float32, head_num=KV_HEADS[False], head_dim=HEAD_DIM,
        v_head_dim=V_HEAD_DIM, swa_head_num=KV_HEADS[True], swa_head_dim=HEAD_DIM, swa_v_head_dim=V_HEAD_DIM,
        swa_attention_layer_ids=SWA_IDS, full_attention_layer_ids=FULL_IDS, device="cpu", token_to_kv_pool_class=pool_cls,
        enable_memory_saver=False,
    )


def radix(layer_id: int) -> RadixAttention:
    swa = layer_id in SWA_IDS
    return RadixAttention(
        num_heads=Q_HEADS, head_dim=HEAD_DIM, scaling=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS[swa], layer_id=layer_id,
        v_head_dim=V_HEAD_DIM, sliding_window_size=WINDOW if swa else -1,
    )


class HybridWorld:
    """An SWAKVPool with its slot mapping, a request table, the K/V every (layer, request, position)
    holds, and the backend. ``place`` maps the SWA pages a batch can see and frees the rest."""

    def __init__(self, pool_cls: type, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = make_pool(pool_cls)
        self.mapping = torch.zeros(FULL_SLOTS + PAGE + 1, dtype=torch.int64)
        self.mapping[-1] = -1
        self.pool.register_mapping(self.mapping)
        self.req_to_token = torch.zeros((MAX_REQS, MAX_CONTEXT), dtype=torch.int32)
        pages = (torch.randperm(FULL_SLOTS // PAGE - 1, generator=self.gen) + 1).tolist()
        per_req = MAX_CONTEXT // PAGE
        for r in range(MAX_REQS):
            mine = torch.tensor(pages[r * per_req : (r + 1) * per_req])
            self.req_to_token[r] = mine.repeat_interleave(PAGE) * PAGE + torch.arange(MAX_CONTEXT) % PAGE
        self.free_swa_pages = (torch.randperm(SWA_SLOTS // PAGE, generator=self.gen) + 1).tolist()
        self.k = {i: torch.randn((MAX_REQS, MAX_CONTEXT, KV_HEADS[i in SWA_IDS], HEAD_DIM), generator=self.gen, dtype=torch.float64) for i in FULL_IDS + SWA_IDS}
        self.v = {i: torch.randn((MAX_REQS, MAX_CONTEXT, KV_HEADS[i in SWA_IDS], V_HEAD_DIM), generator=self.gen, dtype=torch.float64) for i in FULL_IDS + SWA_IDS}
        runner = types.SimpleNamespace(
            device="cpu", req_to_token_pool=types.SimpleNamespace(req_to_token=self.req_to_token), token_to_kv_pool=self.pool,
            model_config=types.SimpleNamespace(context_len=MAX_CONTEXT), sliding_window_size=WINDOW,
        )
        self.backend = HalAttnBackend(runner, hal.get_backend("cpu"))

    def place(self, reqs: list[int], prefix: list[int], q_lens: list[int]) -> None:
        """Give every page a request can see this forward an SWA page; pages wholly before its
        window are freed (mapping 0), as SGLang's SWA eviction leaves them."""
        for r, p, q in zip(reqs, prefix, q_lens):
            first_seen = max(0, p - WINDOW)
            for page in range(-(-(p + q) // PAGE)):
                slots = self.req_to_token[r, page * PAGE : (page + 1) * PAGE].long()
                if (page + 1) * PAGE <= first_seen:
                    self.mapping[slots] = 0
                elif int(self.mapping[slots[0]]) == 0:
                    self.mapping[slots] = self.free_swa_pages.pop() * PAGE + torch.arange(PAGE)

    def write_prefix(self, reqs: list[int], prefix: list[int]) -> None:
        """Positions ``0..prefix-1`` of each request, written by SGLang's own pool code (SWA layers
        only where an SWA page backs them)."""
        for layer_id in FULL_IDS + SWA_IDS:
            for r, n in zip(reqs, prefix):
                loc = self.req_to_token[r, :n].long()
                k, v = self.k[layer_id][r, :n].float(), self.v[layer_id][r, :n].float()
                if layer_id in SWA_IDS:
                    swa = self.mapping[loc]
                    keep = swa > 0
                    self.pool.set_kv_buffer(radix(layer_id), KVWriteLoc(loc[keep], swa[keep]), k[keep], v[keep])
                else:
                    self.pool.set_kv_buffer(radix(layer_id), loc, k, v)


def oracle(q: torch.Tensor, world: HybridWorld, layer_id: int, reqs: list[int], q_lens: list[int], kv_lens: list[int], sinks: torch.Tensor | None) -> torch.Tensor:
    """Dense attention over the K/V each position was given: row j of a request sits at position
    kv - q + j and sees keys max(0, p - W) .. p on SWA layers (0 .. p on full ones); a sink adds
    exp(sink) to each head's softmax denominator."""
    swa = layer_id in SWA_IDS
    group = Q_HEADS // KV_HEADS[swa]
    out, row = [], 0
    for r, ql, kl in zip(reqs, q_lens, kv_lens):
        k = world.k[layer_id][r, :kl].repeat_interleave(group, dim=1)
        v = world.v[layer_id][r, :kl].repeat_interleave(group, dim=1)
        for j in range(ql):
            p = kl - ql + j
            lo = max(0, p - WINDOW) if swa else 0
            scores = torch.einsum("hd,khd->hk", q[row].double(), k[lo : p + 1]) * HEAD_DIM**-0.5
            if sinks is not None:
                scores = torch.cat([scores, sinks.double().unsqueeze(1)], dim=1)
            probs = scores.softmax(-1)[:, : p + 1 - lo]
            out.append(torch.einsum("hk,khd->hd", probs, v[lo : p + 1]))
            row += 1
    return torch.stack(out).reshape(row, Q_HEADS * V_HEAD_DIM)


CASES = [
    (ForwardMode.EXTEND, [0, 3, 5], [0, 16, 29], [9, 5, 12]),
    (ForwardMode.DECODE, [1, 2, 7], [4, 15, 38], [1, 1, 1]),
    (ForwardMode.TARGET_VERIFY, [2, 6], [7, 33], [4, 4]),
    (ForwardMode.DRAFT_EXTEND_V2, [4, 0, 1], [3, 19, 27], [3, 3, 3]),
]


@pytest.mark.parametrize("pool_cls", [HalMHATokenToKVPool, MHATokenToKVPool], ids=["hal-sub-pools", "in-tree-sub-pools"])
@pytest.mark.parametrize(("mode", "reqs", "prefix", "q_lens"), CASES, ids=[c[0].name for c in CASES])
def test_hybrid_forward_matches_dense_oracle(pool_cls: type, mode: ForwardMode, reqs: list[int], prefix: list[int], q_lens: list[int]) -> None:
    world = HybridWorld(pool_cls, seed=len(reqs) * 7 + sum(prefix))
    world.place(reqs, prefix, q_lens)
    assert any(int(world.mapping[world.req_to_token[r, 0]]) == 0 for r, p in zip(reqs, prefix) if p > WINDOW + PAGE)
    world.write_prefix(reqs, prefix)
    fb = make_batch(mode, world, reqs, prefix, q_lens)
    world.backend.init_forward_metadata(fb)
    kv = [p + q for p, q in zip(prefix, q_lens)]
    forward = world.backend.forward_decode if mode == ForwardMode.DECODE else world.backend.forward_extend
    sinks = torch.randn(Q_HEADS, generator=world.gen)
    for layer_id in FULL_IDS + SWA_IDS:
        swa = layer_id in SWA_IDS
        k_new = torch.cat([world.k[layer_id][r, p:n] for r, p, n in zip(reqs, prefix, kv)]).float()
        v_new = torch.cat([world.v[layer_id][r, p:n] for r, p, n in zip(reqs, prefix, kv)]).float()
        q = torch.randn((sum(q_lens), Q_HEADS, HEAD_DIM), generator=world.gen)
        layer_sinks = sinks if swa else None
        out = forward(q.reshape(len(q), -1), k_new.reshape(len(q), -1), v_new.reshape(len(q), -1), radix(layer_id), fb, sinks=layer_sinks)
        expected = oracle(q, world, layer_id, reqs, q_lens, kv, layer_sinks)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"layer {layer_id}: {m}")
        # The new K/V is where SGLang reads it: its sub-pool at the slot its mapping gives.
        loc = world.mapping[fb.out_cache_loc] if swa else fb.out_cache_loc
        torch.testing.assert_close(world.pool.get_key_buffer(layer_id)[loc], k_new)
        torch.testing.assert_close(world.pool.get_value_buffer(layer_id)[loc], v_new)


def test_one_copy_of_the_hybrid_kv() -> None:
    """Both of SGLang's sub-pools are views of one hybrid hal pool, head counts and dims their own."""
    world = HybridWorld(MHATokenToKVPool, seed=1)
    hal_pool = world.backend.pool
    assert hal_pool.spec.swa is not None and hal_pool.spec.swa.layer_ids == tuple(SWA_IDS)
    assert (hal_pool.spec.size, hal_pool.spec.swa.size) == (FULL_SLOTS, SWA_SLOTS)
    for sub, ids in ((world.pool.full_kv_pool, FULL_IDS), (world.pool.swa_kv_pool, SWA_IDS)):
        for index, layer_id in enumerate(ids):
            assert sub.k_buffer[index].data_ptr() == hal_pool.k_buffer(layer_id).data_ptr()
            assert sub.v_buffer[index].data_ptr() == hal_pool.v_buffer(layer_id).data_ptr()
            assert sub.k_buffer[index].shape[1] == KV_HEADS[layer_id in SWA_IDS]
        assert sub.k_data_ptrs.tolist() == [hal_pool.k_buffer(i).data_ptr() for i in ids]
    assert world.pool.swa_kv_pool.k_buffer[0].shape[0] == SWA_SLOTS + PAGE


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_freed_swa_page_inside_the_window_is_refused_before_anything_is_written(graph: bool) -> None:
    world = HybridWorld(HalMHATokenToKVPool, seed=2)
    reqs, prefix, q_lens = [1, 3], [20, 30], [1, 1]
    world.place(reqs, prefix, q_lens)
    world.write_prefix(reqs, prefix)
    seen = world.req_to_token[3, 30 - WINDOW].long()  # the window's first key of request 3
    page = torch.div(seen, PAGE, rounding_mode="floor") * PAGE + torch.arange(PAGE)
    world.mapping[page] = 0  # freed while still in the window
    fb = make_batch(ForwardMode.DECODE, world, reqs, prefix, q_lens)
    before = [t.clone() for t in world.backend.pool.sub_pool_buffers()["swa"]]
    with pytest.raises(CacheLocationError, match=rf"request 1 position {30 - WINDOW} \(full slot {int(seen)}\) maps to SWA slot 0"):
        if graph:
            world.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        else:
            world.backend.init_forward_metadata(fb)
    assert all(torch.equal(a, b) for a, b in zip(before, world.backend.pool.sub_pool_buffers()["swa"]))


def test_graph_replay_refreshes_the_swa_block_table() -> None:
    """A graph captured on hybrid metadata replays on a new batch's SWA pages, in the captured tensor."""
    world = HybridWorld(HalMHATokenToKVPool, seed=4)
    world.place([0, 1], [3, 5], [1, 1])
    seen = []
    graphs = captured_by_hal_graphs(world.backend, make_batch(ForwardMode.DECODE, world, [0, 1], [3, 5], [1, 1]),
                                    lambda: seen.append(world.backend.forward_metadata))
    captured = seen[-1].swa_block_table
    world.place([2, 3], [17, 26], [1, 1])
    replayed(graphs, world.backend, make_batch(ForwardMode.DECODE, world, [2, 3], [17, 26], [1, 1]))
    assert seen[-1].swa_block_table is captured
    expected = [
        [int(world.mapping[world.req_to_token[r, i * PAGE]]) // PAGE for i in range(captured.shape[1]) if i * PAGE < n + 1]
        for r, n in ((2, 17), (3, 26))
    ]
    got = [row[: len(e)] for row, e in zip(captured.tolist(), expected)]
    assert got == expected and 0 in expected[1]  # request 3's first pages left its window: freed, read as padding


def test_what_stays_unsupported_is_refused_by_name() -> None:
    ring = make_pool(MHATokenToKVPool)
    ring.swa_req_ring_size = 64
    with pytest.raises(UnsupportedConfigError, match="per-request SWA ring mode"):
        store_in_hal_pool(ring, hal.get_backend("cpu"))
    from sglang.srt.mem_cache.unified_memory_pool import UnifiedSWAKVPool

    unified = UnifiedSWAKVPool.__new__(UnifiedSWAKVPool)  # its type is what is refused
    with pytest.raises(UnsupportedConfigError, match="UnifiedSWAKVPool: unified"):
        store_in_hal_pool(unified, hal.get_backend("cpu"))
