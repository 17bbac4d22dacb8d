"""GraphRunner over the CPU EagerGraph, and the device-neutral graph helpers in hal.graph.

The oracle for every replay is the same forward run eagerly on a twin pool with the same contents:
outputs must match, and the two pools must agree everywhere except slot 0, the padding slot.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hal.backends.cpu import CpuBackend
from hal.backends.cpu.attention import CpuAttention
from hal.graph import EagerGraph
from hal.allocator import KVAllocator, RequestPageTable
from hal.errors import BatchTooLargeError, GraphError, SpecError
from hal.graph import GraphUpdate, capture_span, copy_into, is_capturing, record_updatable_call
from hal.graph_runner import GraphRunner
from hal.metadata import AttentionMetadata, build_metadata
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec

M = ForwardMode
CHEAP = settings.get_profile("hal-cheap")
EXPENSIVE = settings.get_profile("hal-expensive")

HQ, HKV, DK, DV, PAGE = 4, 2, 8, 6, 4
LAYERS = (
    LayerSpec(0, HQ, HKV, DK, DV, scaling=DK**-0.5),
    LayerSpec(1, HQ, HKV, DK, DV, scaling=0.3, sliding_window=5, has_sinks=True),
)
SINKS = torch.tensor([0.5, -1.0, 0.0, 2.0])
INPUTS = {"q": ((HQ, DK), torch.float32), "k": ((HKV, DK), torch.float32), "v": ((HKV, DV), torch.float32)}
SPEC = KVPoolSpec(num_layers=2, size=64 * PAGE, page_size=PAGE, kv_heads=HKV, head_dim=DK, v_head_dim=DV)


class CountingGraph(EagerGraph):
    replays = 0

    def replay(self, update: GraphUpdate | None = None) -> None:
        CountingGraph.replays += 1
        super().replay(update)


class CountingBackend(CpuBackend):
    def create_graph(self, *, tp_group: object = None) -> CountingGraph:
        return CountingGraph()


def two_layer_forward(attention):
    """A tiny two-layer model; returns a tuple holding a dict, to exercise output-tree slicing."""

    def forward(inputs: Mapping[str, torch.Tensor], md: AttentionMetadata) -> Any:
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        first = attention.forward(q, k, v, LAYERS[0], attention.plan(md))
        second = attention.forward(q * 0.5, k * 2.0, v - 1.0, LAYERS[1], attention.plan(md), sinks=SINKS)
        return first, {"second": second, "sum": first + second}

    return forward


class Twin:
    """A runner's pool and an eager twin pool, fed the same requests."""

    def __init__(self, mode: ForwardMode, tpr: int, batch_sizes, max_pages: int = 8, eager_fallback: bool = True, seed: int = 0,
                 replay_captured: bool | None = True):
        self.backend = CountingBackend()
        self.pool, self.twin_pool = self.backend.create_kv_pool(SPEC), self.backend.create_kv_pool(SPEC)
        self.attention, self.twin_attention = self.backend.create_attention(self.pool), CpuAttention(self.twin_pool)
        self.runner = GraphRunner(
            self.backend,
            two_layer_forward(self.attention),
            attention=self.attention,
            mode=mode,
            tokens_per_request=tpr,
            batch_sizes=batch_sizes,
            max_pages_per_request=max_pages,
            inputs=INPUTS,
            eager_fallback=eager_fallback,
            replay_captured=replay_captured,
        )
        self.runner.capture()
        self.mode, self.tpr = mode, tpr
        self.table = RequestPageTable(KVAllocator(self.pool))
        self.kv: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(seed)

    def step(self, requests: list[int]):
        """One forward for ``requests``: each gains ``tpr`` tokens. Returns (runner out, eager out, loc)."""
        tpr = self.tpr
        for r in requests:
            self.kv[r] = self.kv.get(r, 0) + tpr
            self.table.reserve(r, self.kv[r])
        kv = [self.kv[r] for r in requests]
        loc = torch.cat([self.table.slots(r, range(self.kv[r] - tpr, self.kv[r])) for r in requests] or [torch.zeros(0, dtype=torch.int64)])
        t = len(requests) * tpr
        inputs = {name: torch.randn((t, *shape), generator=self.gen) for name, (shape, _) in INPUTS.items()}
        kwargs = dict(kv_lens=kv, q_lens=[tpr] * len(requests), page_table=self.table.table(requests), out_cache_loc=loc)
        out = self.runner.run(inputs, build_metadata(self.mode, pool=self.pool, **kwargs))
        expect = two_layer_forward(self.twin_attention)(inputs, build_metadata(self.mode, pool=self.twin_pool, **kwargs))
        return out, expect, loc

    def assert_pools_agree_outside_slot_zero(self) -> None:
        for layer in range(SPEC.num_layers):
            for get in ("k_buffer", "v_buffer"):
                a, b = getattr(self.pool, get)(layer), getattr(self.twin_pool, get)(layer)
                assert torch.equal(a[1:], b[1:]), f"layer {layer} {get}: pages differ"
                assert torch.equal(a[0, 1:], b[0, 1:]), f"layer {layer} {get}: padding page beyond slot 0 written"


def test_backends_whose_graphs_rerun_python_run_batches_eagerly_at_their_real_size() -> None:
    """On the CPU backend (EagerGraph) the runner captures nothing and replays nothing: each batch
    runs once, unpadded, with the same results and the same pool contents as the eager twin."""
    twin = Twin(M.TARGET_VERIFY, 2, [4], replay_captured=None)
    assert not twin.runner.replay_captured and not twin.runner._captured
    before = CountingGraph.replays
    for requests in ([0, 1, 2], [0], [0, 1, 2, 3, 4]):  # under, at and above the captured size
        out, expect, _ = twin.step(requests)
        assert_same_outputs(out, expect, len(requests) * 2)
    assert CountingGraph.replays == before
    for layer in range(SPEC.num_layers):  # nothing is padded, so even slot 0 agrees
        assert torch.equal(twin.pool.k_buffer(layer), twin.twin_pool.k_buffer(layer))


def assert_same_outputs(out, expect, rows: int) -> None:
    first, rest = out
    assert first.shape[0] == rows and rest["second"].shape[0] == rows and rest["sum"].shape[0] == rows
    torch.testing.assert_close(first, expect[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest["second"], expect[1]["second"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest["sum"], expect[1]["sum"], atol=1e-5, rtol=1e-5)


@CHEAP
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=6), batch=st.integers(0, 70))
def test_padded_batch_size_is_the_smallest_captured_size_that_fits(sizes: list[int], batch: int) -> None:
    runner = GraphRunner(
        CpuBackend(), lambda i, m: None, attention=CpuAttention(CpuBackend().create_kv_pool(SPEC)), mode=M.DECODE,
        tokens_per_request=1, batch_sizes=sizes, max_pages_per_request=2, inputs={},
        replay_captured=True,
    )
    fitting = [s for s in sizes if s >= batch]
    assert runner.padded_batch_size(batch) == (min(fitting) if fitting else None)
    assert runner.max_batch_size == max(sizes)


@EXPENSIVE
@given(
    mode_tpr=st.sampled_from([(M.DECODE, 1), (M.TARGET_VERIFY, 3), (M.DRAFT_EXTEND_V2, 2)]),
    batch_sizes=st.sampled_from([[1, 2, 4], [2, 3], [1]]),
    steps=st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=6, unique=True), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_replays_equal_eager_with_changing_batches(mode_tpr, batch_sizes, steps, seed) -> None:
    mode, tpr = mode_tpr
    twin = Twin(mode, tpr, batch_sizes, seed=seed)
    for requests in steps:
        replays = CountingGraph.replays
        out, expect, _ = twin.step(requests)
        assert_same_outputs(out, expect, len(requests) * tpr)
        replayed = CountingGraph.replays - replays
        assert replayed == (1 if len(requests) <= max(batch_sizes) else 0)  # above the largest: eager
        twin.assert_pools_agree_outside_slot_zero()


def test_padded_rows_write_only_slot_zero() -> None:
    twin = Twin(M.TARGET_VERIFY, 3, [4])
    for buf in [*twin.pool.k_buffers, *twin.pool.v_buffers]:
        buf.normal_()
    before = [b.clone() for b in [*twin.pool.k_buffers, *twin.pool.v_buffers]]
    _, _, loc = twin.step([0, 1, 2])  # 3 real requests padded to 4
    for b_before, b_after in zip(before, [*twin.pool.k_buffers, *twin.pool.v_buffers]):
        changed = (b_before != b_after).flatten(2).any(-1).flatten().nonzero().flatten().tolist()  # slot ids
        assert set(changed) <= set(loc.tolist()) | {0}
        assert 0 in changed  # the padded request's rows did land on the padding slot


def test_eager_fallback_and_batch_too_large() -> None:
    twin = Twin(M.DECODE, 1, [1, 2, 4])
    replays = CountingGraph.replays
    out, expect, _ = twin.step([0, 1, 2, 3, 4])
    assert CountingGraph.replays == replays
    assert_same_outputs(out, expect, 5)

    strict = Twin(M.DECODE, 1, [1, 2, 4], eager_fallback=False)
    with pytest.raises(BatchTooLargeError, match=r"batch of 5 is larger than every captured graph \[1, 2, 4\]"):
        strict.step([0, 1, 2, 3, 4])


def test_block_table_wider_than_captured_falls_back_or_raises() -> None:
    twin = Twin(M.DECODE, 1, [2], max_pages=1)
    twin.kv[0] = PAGE  # the next token opens a second page
    twin.table.reserve(0, PAGE)
    replays = CountingGraph.replays
    out, expect, _ = twin.step([0])
    assert CountingGraph.replays == replays
    assert_same_outputs(out, expect, 1)

    strict = Twin(M.DECODE, 1, [2], max_pages=1, eager_fallback=False)
    strict.kv[0] = PAGE
    strict.table.reserve(0, PAGE)
    with pytest.raises(BatchTooLargeError, match="block table of 2 pages exceeds the captured 1"):
        strict.step([0])


def test_empty_batch_replays_with_the_runner_q_len() -> None:
    twin = Twin(M.TARGET_VERIFY, 3, [2])
    out, expect, _ = twin.step([])
    assert_same_outputs(out, expect, 0)


class HostParamGraph(EagerGraph):
    """An eager graph whose kernels take host-side parameters, like FIA on Ascend: records updates."""

    updates: list[GraphUpdate] = []

    def replay(self, update: GraphUpdate | None = None) -> None:
        assert update is not None
        HostParamGraph.updates.append(update)
        update.apply_buffer_copies()
        copy_into(self._outputs, self._fn())


class HostParamBackend(CpuBackend):
    def create_graph(self, *, tp_group: object = None) -> HostParamGraph:
        return HostParamGraph()


class HostParamAttention(CpuAttention):
    """CPU attention that declares one host parameter per captured call, as an FIA kernel would."""

    def forward(self, q, k, v, layer, metadata, save_kv_cache=True, *, sinks=None):
        record_updatable_call(self, layer)
        return super().forward(q, k, v, layer, metadata, save_kv_cache, sinks=sinks)

    def updatable_params(self, metadata: AttentionMetadata, layer: LayerSpec) -> Mapping[str, Any]:
        return {"actual_seq_kvlen": list(metadata.kv_lens_cpu), "layer": layer.layer_id}


def test_runner_builds_one_host_update_per_captured_call_in_order() -> None:
    backend = HostParamBackend()
    pool = backend.create_kv_pool(SPEC)
    attention = HostParamAttention(pool)
    runner = GraphRunner(
        backend, two_layer_forward(attention), attention=attention, mode=M.TARGET_VERIFY, tokens_per_request=2,
        batch_sizes=[4], max_pages_per_request=4, inputs=INPUTS,
        replay_captured=True,
    )
    runner.capture()
    graph = runner.captured(4).graph
    assert [(kernel, layer.layer_id) for kernel, layer in graph.captured_calls] == [(attention, 0), (attention, 1)]
    md = build_metadata(M.TARGET_VERIFY, kv_lens=[5, 9], q_lens=[2, 2], page_table=[[1, 2], [3, 4, 5]],
                        out_cache_loc=[8, 9, 20, 21], pool=pool)
    HostParamGraph.updates.clear()
    runner.run({name: torch.zeros((4, *shape)) for name, (shape, _) in INPUTS.items()}, md)
    (update,) = HostParamGraph.updates
    padded_kv = [5, 9, 1 + 2 - 1, 1 + 2 - 1]  # two padded requests: fill + q_len - 1
    assert update.host_params == ({"actual_seq_kvlen": padded_kv, "layer": 0}, {"actual_seq_kvlen": padded_kv, "layer": 1})


def test_eager_graph_rejects_host_params() -> None:
    pool = CpuBackend().create_kv_pool(SPEC)
    attention = HostParamAttention(pool)  # host params, but the plain CPU backend's EagerGraph
    runner = GraphRunner(
        CpuBackend(), two_layer_forward(attention), attention=attention, mode=M.DECODE, tokens_per_request=1,
        batch_sizes=[1], max_pages_per_request=2, inputs=INPUTS,
        replay_captured=True,
    )
    runner.capture()
    md = build_metadata(M.DECODE, kv_lens=[1], q_lens=[1], page_table=[[1]], out_cache_loc=[4], pool=pool)
    with pytest.raises(GraphError, match=r"EagerGraph cannot update host-side op parameters \['actual_seq_kvlen', 'layer'\]"):
        runner.run({name: torch.zeros((1, *shape)) for name, (shape, _) in INPUTS.items()}, md)


def test_eager_graph_replay_contract() -> None:
    source = torch.tensor([1.0, 2.0])
    graph = EagerGraph()
    with pytest.raises(GraphError, match="capture\\(\\) first"):
        graph.replay()
    outputs = graph.capture(lambda: (source * 2, [source + 1]))
    static = outputs[0]
    with pytest.raises(GraphError, match="already captured"):
        graph.capture(lambda: source)
    graph.replay(GraphUpdate(buffer_copies=((source, torch.tensor([5.0, 6.0])),), host_params=({}, {})))
    assert static is outputs[0]  # results land in the captured outputs, in place
    assert outputs[0].tolist() == [10.0, 12.0] and outputs[1][0].tolist() == [6.0, 7.0]
    with pytest.raises(GraphError, match=r"cannot update host-side op parameters \['seq'\]"):
        graph.replay(GraphUpdate(host_params=({}, {"seq": [1]})))


def test_graph_update_checks_every_shape_before_copying() -> None:
    a, b = torch.zeros(3), torch.zeros(2)
    update = GraphUpdate(buffer_copies=((a, torch.ones(3)), (b, torch.ones(4))))
    with pytest.raises(GraphError, match=r"copy 1: static buffer has shape \(2,\), new value \(4,\)"):
        update.apply_buffer_copies()
    assert a.tolist() == [0.0, 0.0, 0.0]  # the valid first copy did not happen either


def test_capture_span_collects_updatable_calls_and_does_not_nest() -> None:
    record_updatable_call("ignored", "outside a capture")
    assert not is_capturing()
    with capture_span() as calls:
        assert is_capturing()
        record_updatable_call("kernel-a", 0)
        record_updatable_call("kernel-b", 1)
        record_updatable_call("kernel-a", 2)
        with pytest.raises(GraphError, match="captures do not nest"):
            with capture_span():
                pass
        assert is_capturing()  # the refused inner span left the outer one alone
    assert calls == [("kernel-a", 0), ("kernel-b", 1), ("kernel-a", 2)]
    assert not is_capturing()
    with pytest.raises(RuntimeError, match="inside"):
        with capture_span():
            raise RuntimeError("inside")
    assert not is_capturing()  # an exception ends the span


def test_a_capture_in_one_thread_leaves_the_others_outside_of_it() -> None:
    """Capture state is per thread: while one thread captures, another's calls are not recorded and
    it is not capturing; once every span has closed (an exception included), none is."""
    import hal.graph as graph_module

    inside, leave = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def capture() -> None:
        with capture_span() as calls:
            record_updatable_call("kernel", "capturing thread")
            seen["calls"] = calls
            inside.set()
            leave.wait(30)

    worker = threading.Thread(target=capture)
    worker.start()
    assert inside.wait(30)
    assert not is_capturing() and graph_module.capture_id() == 0
    record_updatable_call("kernel", "other thread")
    with capture_span() as mine:  # this thread may capture at the same time
        assert is_capturing() and graph_module.capture_id() == id(mine)
    leave.set()
    worker.join(30)
    assert seen["calls"] == [("kernel", "capturing thread")] and mine == []
    with pytest.raises(RuntimeError, match="inside"):
        with capture_span():
            raise RuntimeError("inside")
    assert graph_module._open_spans == 0 and not is_capturing()


def test_copy_into_trees() -> None:
    dst = (torch.zeros(2), {"a": torch.zeros(1), "b": [torch.zeros(1)]}, None)
    copy_into(dst, (torch.ones(2), {"a": torch.full((1,), 2.0), "b": [torch.full((1,), 3.0)]}, None))
    assert dst[0].tolist() == [1.0, 1.0] and dst[1]["a"].tolist() == [2.0] and dst[1]["b"][0].tolist() == [3.0]
    with pytest.raises(GraphError, match="got int"):
        copy_into((torch.zeros(1), 5), (torch.zeros(1), 5))


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (dict(mode=M.EXTEND), SpecError, "EXTEND has no fixed per-request shape"),
        (dict(mode=M.IDLE), SpecError, "IDLE has no fixed per-request shape"),
        (dict(mode="decode"), SpecError, "mode must be a hal.ForwardMode, got 'decode'"),
        (dict(tokens_per_request=2), SpecError, "DECODE has 1 token per request"),
        (dict(batch_sizes=[]), SpecError, "batch_sizes is empty"),
        (dict(batch_sizes=[0, 2]), SpecError, "batch_sizes entry must be an int >= 1, got 0"),
        (dict(batch_sizes=[True]), SpecError, "batch_sizes entry must be an int >= 1, got True"),
        (dict(seq_len_fill_value=0), SpecError, "seq_len_fill_value must be an int >= 1, got 0"),
    ],
)
def test_runner_constructor_validation(kwargs, error, fragment: str) -> None:
    pool = CpuBackend().create_kv_pool(SPEC)
    args = dict(attention=CpuAttention(pool), mode=M.DECODE, tokens_per_request=1, batch_sizes=[1, 2],
                max_pages_per_request=2, inputs=INPUTS)
    args.update(kwargs)
    with pytest.raises(error, match=fragment):
        GraphRunner(CpuBackend(), lambda i, m: None, **args, replay_captured=True)


def test_run_validation() -> None:
    pool = CpuBackend().create_kv_pool(SPEC)
    attention = CpuAttention(pool)
    runner = GraphRunner(CpuBackend(), two_layer_forward(attention), attention=attention, mode=M.TARGET_VERIFY,
                         tokens_per_request=2, batch_sizes=[2], max_pages_per_request=2, inputs=INPUTS, replay_captured=True)
    inputs = {name: torch.zeros((2, *shape)) for name, (shape, _) in INPUTS.items()}
    md = build_metadata(M.TARGET_VERIFY, kv_lens=[2], q_lens=[2], page_table=[[1]], out_cache_loc=[4, 5], pool=pool)
    with pytest.raises(GraphError, match=r"capture\(\) first"):
        runner.run(inputs, md)
    runner.capture()
    decode = build_metadata(M.DECODE, kv_lens=[2], q_lens=[1], page_table=[[1]], out_cache_loc=[5], pool=pool)
    with pytest.raises(SpecError, match="GraphRunner for TARGET_VERIFY got DECODE metadata"):
        runner.run(inputs, decode)
    three = build_metadata(M.TARGET_VERIFY, kv_lens=[3], q_lens=[3], page_table=[[1]], out_cache_loc=[4, 5, 6], pool=pool)
    with pytest.raises(SpecError, match=r"every request must have 2 tokens, got q_lens \(3,\)"):
        runner.run(inputs, three)
    with pytest.raises(SpecError, match=r"inputs \['k', 'q'\] differ from the declared \['k', 'q', 'v'\]"):
        runner.run({"q": inputs["q"], "k": inputs["k"]}, md)
    with pytest.raises(GraphError, match="static buffer has shape"):
        runner.run({**inputs, "q": torch.zeros(3, HQ, DK)}, md)
