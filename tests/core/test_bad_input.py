"""No silent corruption: bad input is refused with a typed error that names it, before anything is
written, on every backend (cpu, npu emulated, cuda in the Triton interpreter) and on both paths
(eager ``forward`` and ``GraphRunner`` replay); kernels and pools are safe across threads.

The fuzz tests draw one bad argument per example (its kind and its value) from hypothesis and check
three things: the error is a ``HalError`` subclass of the expected kind, its message names the bad
value, and every KV buffer is bit-identical afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import hal
from hal.allocator import KVAllocator, PageAllocator, RequestPageTable
from hal.backends.npu import emulator
from hal.errors import CacheLocationError, GraphError, HalError, KVLayoutError, PoolTooLargeError, SpecError, UnsupportedConfigError
from hal.graph_runner import GraphRunner
from hal.metadata import AttentionMetadata, build_metadata
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec

M = ForwardMode
PAGE, HQ, D = 16, 4, 128
FULL = LayerSpec(0, HQ, 1, D, D, D**-0.5)
SWA = LayerSpec(1, HQ, 2, D, D, D**-0.5, sliding_window=6, has_sinks=True)
DTYPES = {"cpu": torch.float32, "npu": torch.bfloat16, "cuda": torch.float32}
EXAMPLES = {"cpu": 120, "npu": 60, "cuda": 12}  # the Triton interpreter is slow: a small share
EXAMPLES_PER_KIND = {"cpu": 8, "npu": 5, "cuda": 3}


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Any]]:
    yield {
        "cpu": hal.get_backend("cpu"),
        "npu": hal.get_backend("npu", emulate=True),
        "cuda": hal.get_backend("cuda", emulate=True),
    }


@attrs.define
class World:
    """A hybrid pool (layer 0 full, layer 1 SWA), two live requests and a valid DECODE call."""

    backend: Any
    pool: Any
    attn: Any
    table: RequestPageTable
    md: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: torch.Tensor

    @classmethod
    def build(cls, backend: Any) -> World:
        dt = DTYPES[backend.name]
        spec = KVPoolSpec(2, 8 * PAGE, PAGE, 1, D, D, dt, SWAPoolSpec((1,), 6 * PAGE, 2, D, D))
        pool = backend.create_kv_pool(spec)
        table = RequestPageTable(KVAllocator(pool))
        for rid, n in ((0, 20), (1, 5)):
            table.reserve(rid, n)
        md = build_metadata(M.DECODE, kv_lens=[20, 5], q_lens=[1, 1], page_table=table.table([0, 1]),
                            out_cache_loc=torch.cat([table.slots(0, [19]), table.slots(1, [4])]), pool=pool)
        gen = torch.Generator().manual_seed(0)
        dev = pool.device

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dev, dt)

        world = cls(backend, pool, backend.create_attention(pool), table, md, rand(2, HQ, D), rand(2, 2, D), rand(2, 2, D),
                    torch.randn(HQ, generator=gen).to(dev, dt))
        for layer in (0, 1):  # some history, so a stray write would show
            heads = pool.spec.layer_dims(layer)[0]
            pool.set_kv(layer, torch.arange(PAGE, 3 * PAGE, device=dev), rand(2 * PAGE, heads, D), rand(2 * PAGE, heads, D))
        return world

    def snapshot(self) -> list[torch.Tensor]:
        return [b.detach().cpu().clone() for layer in range(2) for b in (self.pool.k_buffer(layer), self.pool.v_buffer(layer))]

    def forward_swa(self, **overrides: Any) -> torch.Tensor:
        args = {"q": self.q, "k": self.k, "v": self.v, "layer": SWA, "metadata": self.md, "sinks": self.sinks, "out": None, **overrides}
        return self.attn.forward(args["q"], args["k"], args["v"], args["layer"], self.attn.plan(args["metadata"]), sinks=args["sinks"],
                                 out=args["out"])

    def runner(self) -> GraphRunner:
        inputs = {"q": ((HQ, D), self.q.dtype), "k": ((2, D), self.k.dtype), "v": ((2, D), self.v.dtype)}
        runner = GraphRunner(
            self.backend, lambda x, md: self.attn.forward(x["q"], x["k"], x["v"], SWA, self.attn.plan(md), sinks=self.sinks),
            attention=self.attn, mode=M.DECODE, tokens_per_request=1, batch_sizes=[2], max_pages_per_request=4, inputs=inputs,
            replay_captured=True,
        )  # fmt: skip
        with torch.no_grad():
            runner.capture()
        return runner


def expect_refused(world: World, call: Callable[[], Any], error: type[HalError], names: str) -> None:
    """``call`` raises ``error`` whose message contains ``names``; every KV buffer is unchanged."""
    before = world.snapshot()
    with pytest.raises(error) as info:
        call()
    assert names in str(info.value), f"{names!r} not in {str(info.value)!r}"
    after = world.snapshot()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after)), "KV changed"


def bad_metadata(world: World, *, loc: int | None = None, page: int | None = None) -> AttentionMetadata:
    """The world's metadata with its second slot (or page id) replaced, on device and host alike."""
    md = world.md
    out: dict[str, Any] = {}
    if loc is not None:
        host = md.out_cache_loc_host.clone()
        host[1] = loc
        out.update(out_cache_loc=host.to(md.out_cache_loc.device), out_cache_loc_host=host)
    if page is not None:
        host = md.block_table_host.clone()
        host[1, 0] = page
        out.update(block_table=host.to(md.block_table.device), block_table_host=host)
    return attrs.evolve(md, **out)


# ------------------------------------------------------------------------------------------------
# 1. captured graphs check slots and page ids like the eager path


@pytest.mark.parametrize("name", ["cpu", "npu"])
def test_replay_refuses_bad_slots_and_pages_before_copying(backends: dict[str, Any], name: str) -> None:
    world = World.build(backends[name])
    runner = world.runner()
    x = {"q": world.q, "k": world.k, "v": world.v}
    limit = (world.pool.spec.num_pages + 1) * PAGE
    unmapped_page = next(p for p in range(1, world.pool.spec.num_pages + 1) if p not in sum(world.table.table([0, 1]), []))
    cases = [
        (bad_metadata(world, loc=-1), CacheLocationError, "cache location -1"),
        (bad_metadata(world, loc=10**6), CacheLocationError, "cache location 1000000"),
        (bad_metadata(world, loc=limit), CacheLocationError, f"cache location {limit}"),
        (bad_metadata(world, loc=unmapped_page * PAGE + 3), CacheLocationError, "no SWA page mapped"),
        (bad_metadata(world, page=world.pool.spec.num_pages + 1), CacheLocationError, f"page id {world.pool.spec.num_pages + 1}"),
    ]
    for md, error, names in cases:
        expect_refused(world, lambda: runner.run(x, md), error, names)  # graph path
        expect_refused(world, lambda: world.forward_swa(metadata=md), error, names)  # eager path


def test_build_metadata_refuses_negative_slots_with_or_without_a_pool() -> None:
    pool = hal.get_backend("cpu").create_kv_pool(KVPoolSpec(1, 4 * PAGE, PAGE, 1, 8, 8))
    for kwargs in ({"pool": pool}, {"page_size": PAGE}):
        with pytest.raises(SpecError, match="negative slot -1"):
            build_metadata(M.DECODE, kv_lens=[3], q_lens=[1], page_table=[[1]], out_cache_loc=[-1], **kwargs)


# ------------------------------------------------------------------------------------------------
# 2. one kernel, several threads


def test_one_cpu_kernel_from_two_threads_matches_sequential(backends: dict[str, Any]) -> None:
    world = World.build(backends["cpu"])
    calls = [(layer, seed) for layer in (FULL, SWA) for seed in range(30)]

    def call(layer: LayerSpec, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        heads = layer.num_kv_heads
        q = torch.randn(2, HQ, D, generator=gen)
        k, v = torch.randn(2, heads, D, generator=gen), torch.randn(2, heads, D, generator=gen)
        sinks = world.sinks if layer.has_sinks else None
        return world.attn.forward(q, k, v, layer, world.attn.plan(world.md), save_kv_cache=False, sinks=sinks)

    expected = {c: call(*c) for c in calls}
    got: dict[tuple[LayerSpec, int], torch.Tensor] = {}
    barrier = threading.Barrier(2)

    def worker(layer: LayerSpec) -> None:
        barrier.wait()
        for c in calls:
            if c[0] == layer:
                got[c] = call(*c)

    threads = [threading.Thread(target=worker, args=(layer,)) for layer in (FULL, SWA)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrong = [c for c in calls if not torch.equal(got[c], expected[c])]
    assert not wrong, f"{len(wrong)} of {len(calls)} outputs differ from the sequential ones"


@pytest.mark.parametrize("name", ["cpu", "npu", "cuda"])
def test_thread_stress_kernel_and_pool(backends: dict[str, Any], name: str) -> None:
    """Each thread writes its own layer's slots and attends; results equal a sequential run."""
    rounds = 2 if name == "cuda" else 6

    def run(world: World, layer: LayerSpec, r: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(100 * layer.layer_id + r)
        dt, dev, heads = world.q.dtype, world.pool.device, layer.num_kv_heads
        q = torch.randn(2, HQ, D, generator=gen).to(dev, dt)
        k, v = (torch.randn(2, heads, D, generator=gen).to(dev, dt) for _ in range(2))
        return world.attn.forward(q, k, v, layer, world.attn.plan(world.md), sinks=world.sinks if layer.has_sinks else None)

    sequential = World.build(backends[name])
    expected = {(layer.layer_id, r): run(sequential, layer, r) for r in range(rounds) for layer in (FULL, SWA)}
    threaded = World.build(backends[name])
    got: dict[tuple[int, int], torch.Tensor] = {}
    barrier = threading.Barrier(2)

    def worker(layer: LayerSpec) -> None:
        barrier.wait()
        for r in range(rounds):
            got[(layer.layer_id, r)] = run(threaded, layer, r)

    threads = [threading.Thread(target=worker, args=(layer,)) for layer in (FULL, SWA)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(got[key], expected[key]) for key in expected)
    assert all(torch.equal(a, b) for a, b in zip(threaded.snapshot(), sequential.snapshot()))


def test_graph_runner_refuses_a_second_concurrent_caller(backends: dict[str, Any]) -> None:
    world = World.build(backends["cpu"])
    entered, release = threading.Event(), threading.Event()
    runner = GraphRunner(
        world.backend, lambda x, md: (entered.set(), release.wait(10), x["q"] * 1)[-1], attention=world.attn,
        mode=M.DECODE, tokens_per_request=1, batch_sizes=[2], max_pages_per_request=4, inputs={"q": ((HQ, D), torch.float32)},
        replay_captured=True,
    )  # fmt: skip
    release.set()  # capture runs the forward once: let it through
    runner.capture()
    entered.clear()
    release.clear()
    first = threading.Thread(target=runner.run, args=({"q": world.q}, world.md))
    first.start()
    assert entered.wait(10)
    with pytest.raises(GraphError, match="already running on another thread"):
        runner.run({"q": world.q}, world.md)
    release.set()
    first.join()


# ------------------------------------------------------------------------------------------------
# 3-6. single refusals that used to be silent, late or untyped


@pytest.mark.parametrize("name", ["cpu", "npu", "cuda"])
def test_tensors_on_another_device_are_refused_before_the_write(backends: dict[str, Any], name: str) -> None:
    world = World.build(backends[name])
    expect_refused(world, lambda: world.forward_swa(q=world.q.to("meta")), KVLayoutError, "q is on meta")
    expect_refused(world, lambda: world.forward_swa(sinks=world.sinks.to("meta")), KVLayoutError, "sinks is on meta")


def test_non_integral_lengths_slots_and_counts_are_refused() -> None:
    with pytest.raises(SpecError, match=r"out_cache_loc\[0\] must be an int, got 128.9"):
        build_metadata(M.DECODE, kv_lens=[3], q_lens=[1], page_table=[[8]], out_cache_loc=[128.9], page_size=PAGE)
    with pytest.raises(SpecError, match=r"kv_lens\[0\] must be an int, got 5.7"):
        build_metadata(M.DECODE, kv_lens=[5.7], q_lens=[1], page_table=[[1]], out_cache_loc=[20], page_size=PAGE)
    with pytest.raises(SpecError, match="out_cache_loc must be an int32/int64 tensor, got torch.float32"):
        build_metadata(M.DECODE, kv_lens=[3], q_lens=[1], page_table=[[1]], out_cache_loc=torch.tensor([18.0]), page_size=PAGE)
    with pytest.raises(SpecError, match="must be an int, got the bool True"):
        build_metadata(M.DECODE, kv_lens=[True], q_lens=[1], page_table=[[1]], out_cache_loc=[16], page_size=PAGE)
    with pytest.raises(SpecError, match="page count must be an int >= 0, got True"):
        PageAllocator(4).alloc(True)
    table = RequestPageTable(KVAllocator(hal.get_backend("cpu").create_kv_pool(KVPoolSpec(1, 4 * PAGE, PAGE, 1, 8, 8))))
    with pytest.raises(SpecError, match="num_tokens must be an int, got 3.5"):
        table.reserve(0, 3.5)  # type: ignore[arg-type]


def test_graph_runner_inputs_follow_the_eager_rules(backends: dict[str, Any]) -> None:
    world = World.build(backends["cpu"])
    runner = world.runner()
    x = {"q": world.q.half(), "k": world.k, "v": world.v}
    expect_refused(world, lambda: runner.run(x, world.md), GraphError, "has dtype torch.float16")
    expect_refused(world, lambda: world.forward_swa(q=world.q.half()), KVLayoutError, "q has dtype torch.float16")
    expect_refused(world, lambda: runner.run({**x, "q": [1.0]}, world.md), SpecError, "must be a torch.Tensor, got list")


def test_untyped_refusals_are_typed(backends: dict[str, Any]) -> None:
    world = World.build(backends["cpu"])
    no_pool = build_metadata(M.DECODE, kv_lens=[20, 5], q_lens=[1, 1], page_table=[[1, 2], [99]],
                             out_cache_loc=world.md.out_cache_loc_host, page_size=PAGE)
    k, v = world.k[:, :1], world.v[:, :1]
    expect_refused(world, lambda: world.forward_swa(k=k, v=v, layer=FULL, metadata=no_pool, sinks=None), CacheLocationError, "page id 99")
    with pytest.raises(SpecError, match="mode must be a hal.ForwardMode, got 'DECODE'"):
        build_metadata("DECODE", kv_lens=[1], q_lens=[1], page_table=[[1]], out_cache_loc=[16], page_size=PAGE)  # type: ignore[arg-type]
    expect_refused(world, lambda: world.forward_swa(q=world.q.tolist()), SpecError, "q must be a torch.Tensor, got list")
    with pytest.raises(SpecError, match="IDLE carries no tokens"):
        build_metadata(M.IDLE, kv_lens=[2], q_lens=[1], page_table=[[1]], out_cache_loc=[16], page_size=PAGE)
    for kwargs in ({"tokens_per_request": 0}, {"max_pages_per_request": 0}, {"max_pages_per_request": True}):
        args = {"tokens_per_request": 1, "max_pages_per_request": 4, **kwargs}
        name, value = next(iter(kwargs.items()))
        with pytest.raises(SpecError, match=f"GraphRunner.{name} must be an int >= 1, got {value}"):
            GraphRunner(world.backend, lambda x, md: x, attention=world.attn, mode=M.DECODE, batch_sizes=[1], inputs={}, **args, replay_captured=True)
    table = RequestPageTable(KVAllocator(world.backend.create_kv_pool(KVPoolSpec(1, 2 * PAGE, PAGE, 1, 8, 8))))
    with pytest.raises(hal.OutOfPagesError):
        table.reserve(7, 10 * PAGE)
    assert 7 not in table
    for bad in (float("inf"), float("nan"), True):
        with pytest.raises(SpecError, match="scaling must be a positive, finite float"):
            LayerSpec(0, 4, 1, 8, 8, scaling=bad)


def test_generate_refuses_a_float_token_limit() -> None:
    from hal.speculative import GreedyDecoder, TinyConfig, TinyMiMo

    decoder = GreedyDecoder(TinyMiMo(TinyConfig(num_layers=2, num_mtp_layers=1)), hal.get_backend("cpu"), max_batch_size=1, max_seq_len=32,
                            graph_batch_sizes=[1])
    with pytest.raises(SpecError, match="max_new_tokens for prompt 0 must be an int >= 1, got 2.5"):
        decoder.generate([[1, 2]], 2.5)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"prompt 0\[1\] must be an int, got 2.0"):
        decoder.generate([[1, 2.0]], 2)  # type: ignore[list-item]


# ------------------------------------------------------------------------------------------------
# 7. the NPU backend against the op's documentation


def test_npu_backend_passes_a_contiguous_query_and_the_op_refuses_strided_ones(backends: dict[str, Any]) -> None:
    world = World.build(backends["npu"])
    fused = torch.cat([world.q, world.q], dim=-1)  # a q that is a view of a fused projection
    strided = fused[..., :D]
    assert not strided.is_contiguous()
    out = world.forward_swa(q=strided, metadata=world.md)
    assert torch.equal(out, world.forward_swa(q=world.q.clone(), metadata=world.md))
    k_cache = world.pool.k_buffer(0).view(world.pool.k_buffer(0).shape[0], PAGE, -1)
    v_cache = world.pool.v_buffer(0).view(world.pool.v_buffer(0).shape[0], PAGE, -1)
    kwargs = world.attn.fia_arguments(FULL, world.md, None)
    with pytest.raises(emulator.NpuOpError, match="query must be contiguous"):
        emulator.FIA_V2(strided, k_cache, v_cache, **kwargs)


def test_npu_refuses_192_192_with_a_paged_cache(backends: dict[str, Any]) -> None:
    npu = backends["npu"]
    layer = LayerSpec(0, 4, 1, 192, 192, 192**-0.5)
    pool = npu.create_kv_pool(KVPoolSpec(1, 4 * 128, 128, 1, 192, 192, torch.bfloat16))
    md = build_metadata(M.DECODE, kv_lens=[3], q_lens=[1], page_table=[[1]], out_cache_loc=[130], pool=pool)
    q, kv = torch.zeros(1, 4, 192, dtype=torch.bfloat16), torch.zeros(1, 1, 192, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedConfigError, match="v head dim 192"):
        (attn := npu.create_attention(pool)).forward(q, kv, kv, layer, attn.plan(md))
    k_cache = pool.k_buffer(0).view(-1, 128, 192)
    with pytest.raises(emulator.NpuOpError, match="does not support a v head dim of 192"):
        emulator.FIA_V2(q, k_cache, k_cache, block_table=md.block_table, actual_seq_qlen=[1], actual_seq_kvlen=[3],
                        num_query_heads=4, num_key_value_heads=1, input_layout="TND", sparse_mode=0, block_size=128)


def test_npu_probe_reports_an_old_torch_npu_as_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from hal.backends.npu import NpuBackend, runtime

    monkeypatch.setattr(runtime, "is_installed", lambda: True)
    monkeypatch.delitem(__import__("sys").modules, "torch_npu", raising=False)
    monkeypatch.setattr(runtime, "installed_version", lambda: "2.7.1.post2")
    info = NpuBackend.probe()
    assert not info.available and "torch_npu 2.7.1.post2 is older than 2.8.0" in info.reason
    monkeypatch.setattr(runtime, "installed_version", lambda: "2.8.0.post2")
    assert "older" not in NpuBackend.probe().reason
    assert runtime.version_tuple("2.10.0rc1") == (2, 10, 0) > runtime.MIN_TORCH_NPU


def test_npu_default_page_size_is_128(backends: dict[str, Any]) -> None:
    from hal.speculative import GreedyDecoder, TinyConfig, TinyMiMo

    assert backends["npu"].default_page_size == 128 and backends["cpu"].default_page_size == 16
    model = TinyMiMo(TinyConfig(num_layers=2, num_mtp_layers=1, qk_head_dim=128, v_head_dim=128))
    decoder = GreedyDecoder(model, hal.get_backend("npu", emulate=True), kv_dtype=torch.bfloat16, max_batch_size=1, max_seq_len=64,
                            graph_batch_sizes=[1])
    assert decoder.target_pool.spec.page_size == 128


def test_npu_graph_update_thread_sets_the_capture_device(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = hal.get_backend("npu", emulate=True)
    monkeypatch.setattr(emulator.runtime, "_device_count", 2)
    backend.runtime.npu.set_device(1)
    try:
        world = World.build(backend)
        runner = world.runner()
        out = runner.run({"q": world.q, "k": world.k, "v": world.v}, world.md)
        assert out.shape == (2, HQ, D)
    finally:
        backend.runtime.npu.set_device(0)


# ------------------------------------------------------------------------------------------------
# 8. fuzz: one bad argument per example, every backend, both paths


def _bad_dtype(world: World) -> torch.dtype:
    return torch.float16 if world.q.dtype != torch.float16 else torch.float32


MUTATIONS: dict[str, Callable[[World, Any], tuple[Callable[[], Any], type[HalError], str]]] = {
    "q dtype": lambda w, _: (lambda: w.forward_swa(q=w.q.to(_bad_dtype(w))), KVLayoutError, f"q has dtype {_bad_dtype(w)}"),
    "q heads": lambda w, n: (lambda: w.forward_swa(q=w.q[:, :1].expand(2, n + HQ + 1, D)), SpecError, f"q has shape (2, {n + HQ + 1}, {D})"),
    "k head dim": lambda w, n: (lambda: w.forward_swa(k=w.k[..., :n]), SpecError, f"k has shape (2, 2, {n})"),
    "v rows": lambda w, n: (lambda: w.forward_swa(v=w.v[:1].expand(n + 3, 2, D)), SpecError, f"v has shape ({n + 3}, 2, {D})"),
    "q type": lambda w, _: (lambda: w.forward_swa(q=w.q.tolist()), SpecError, "q must be a torch.Tensor, got list"),
    "q None": lambda w, _: (lambda: w.forward_swa(q=None), SpecError, "q must be a torch.Tensor, got None"),
    "k None while saving": lambda w, _: (lambda: w.forward_swa(k=None), SpecError, "k must be a torch.Tensor, got None (k and v may be None only with save_kv_cache=False)"),
    "attention over no pool": lambda w, _: (lambda: w.backend.create_attention(None), SpecError, "pool must be a KV pool (see create_kv_pool), got NoneType"),
    "pool spec None": lambda w, _: (lambda: w.backend.create_kv_pool(None), SpecError, "spec must be a hal.KVPoolSpec, got NoneType"),
    "set_kv loc None": lambda w, _: (lambda: w.pool.set_kv(1, None, w.k, w.v), KVLayoutError, "loc must be a 1-D int32/int64 tensor, got NoneType"),
    "pool size overflows": lambda w, n: (lambda: w.backend.create_kv_pool(KVPoolSpec(2, PAGE << (55 + n % 4), PAGE, 1, D, D)), PoolTooLargeError, "more than a tensor can hold"),
    "pool above device memory": lambda w, n: (lambda: w.backend.create_kv_pool(KVPoolSpec(2, PAGE << (36 + n % 8), PAGE, 1, D, D)), PoolTooLargeError, "more than the device's"),
    "q device": lambda w, _: (lambda: w.forward_swa(q=w.q.to("meta")), KVLayoutError, "q is on meta"),
    "sinks shape": lambda w, n: (lambda: w.forward_swa(sinks=w.sinks[:1].expand(n + HQ + 1)), SpecError, f"sinks have shape ({n + HQ + 1},)"),
    "sinks missing": lambda w, _: (lambda: w.forward_swa(sinks=None), SpecError, "has_sinks=True but sinks were not given"),
    "layer dims": lambda w, n: (lambda: w.forward_swa(layer=attrs.evolve(SWA, num_kv_heads=4)), KVLayoutError, "the pool stores (2, 128, 128)"),
    "layer id": lambda w, n: (lambda: w.forward_swa(layer=attrs.evolve(SWA, layer_id=2 + n)), KVLayoutError, f"layer must be an int in 0..1, got {2 + n}"),
    "swa without window": lambda w, _: (lambda: w.forward_swa(layer=attrs.evolve(SWA, sliding_window=None)), SpecError, "sliding_window is None"),
    "slot above": lambda w, n: (lambda: w.forward_swa(metadata=bad_metadata(w, loc=9 * PAGE + n)), CacheLocationError, f"cache location {9 * PAGE + n}"),
    "slot negative": lambda w, n: (lambda: w.forward_swa(metadata=bad_metadata(w, loc=-1 - n)), CacheLocationError, f"cache location {-1 - n}"),
    "slot unmapped": lambda w, n: (lambda: w.forward_swa(metadata=bad_metadata(w, loc=8 * PAGE + n % PAGE)), CacheLocationError, "no SWA page mapped"),
    "page id": lambda w, n: (lambda: w.forward_swa(metadata=bad_metadata(w, page=9 + n)), CacheLocationError, f"page id {9 + n}"),
    "page size": lambda w, _: (lambda: w.forward_swa(metadata=attrs.evolve(w.md, page_size=PAGE * 2)), SpecError, f"page_size={PAGE * 2}"),
    "set_kv slot": lambda w, n: (lambda: w.pool.set_kv(1, torch.tensor([3 * PAGE, 50 * PAGE + n], device=w.pool.device), w.k, w.v), CacheLocationError, f"cache location {50 * PAGE + n}"),
    "set_kv float loc": lambda w, _: (lambda: w.pool.set_kv(1, torch.tensor([16.0, 17.0], device=w.pool.device), w.k, w.v), KVLayoutError, "loc must be a 1-D int32/int64 tensor, got torch.float32"),
    "out shape": lambda w, n: (lambda: w.forward_swa(out=torch.empty(2, HQ, D + n + 1, dtype=w.q.dtype, device=w.q.device)), SpecError, f"out must be a {w.q.dtype} tensor of shape (2, {HQ}, {D}) on {w.q.device}, got a {w.q.dtype} tensor of shape (2, {HQ}, {D + n + 1})"),
    "out dtype": lambda w, _: (lambda: w.forward_swa(out=torch.empty(2, HQ, D, dtype=_bad_dtype(w), device=w.q.device)), SpecError, f"got a {_bad_dtype(w)} tensor"),
    "out strided": lambda w, n: (lambda: w.forward_swa(out=torch.empty(2, HQ, D * (n + 2), dtype=w.q.dtype, device=w.q.device)[..., :D]), SpecError, "out must be contiguous"),
    "out type": lambda w, _: (lambda: w.forward_swa(out=[0.0]), SpecError, "got list"),
    "set_kv dtype": lambda w, _: (lambda: w.pool.set_kv(0, torch.tensor([16, 17], device=w.pool.device), w.k[:, :1].to(_bad_dtype(w)), w.v[:, :1]), KVLayoutError, f"k has dtype {_bad_dtype(w)}"),
}  # fmt: skip
GRAPH_MUTATIONS = ("slot above", "slot negative", "slot unmapped", "page id")


@pytest.mark.parametrize("name", ["cpu", "npu", "cuda"])
def test_fuzz_bad_input_is_refused_before_any_write(backends: dict[str, Any], name: str) -> None:
    """Every kind of bad argument on every backend, with hypothesis drawing its value (refusals run
    no kernel, so even the Triton interpreter is cheap here)."""
    world = World.build(backends[name])

    for kind in sorted(MUTATIONS):

        @settings(max_examples=EXAMPLES_PER_KIND[name], deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(n=st.integers(0, 40))
        def check(n: int) -> None:
            if kind == "k head dim" and n in (0, D):
                n = 7  # an empty or a whole head dim is no mutation
            event(kind)
            call, error, names = MUTATIONS[kind](world, n)
            expect_refused(world, call, error, names)

        check()


@pytest.mark.parametrize("name", ["cpu", "npu"])
def test_fuzz_graph_path_refuses_what_the_eager_path_refuses(backends: dict[str, Any], name: str) -> None:
    world = World.build(backends[name])
    runner = world.runner()
    x = {"q": world.q, "k": world.k, "v": world.v}

    @settings(max_examples=EXAMPLES[name] // 2, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(kind=st.sampled_from(GRAPH_MUTATIONS), n=st.integers(0, 40))
    def check(kind: str, n: int) -> None:
        event(kind)
        call, error, names = MUTATIONS[kind](world, n)
        md = {"slot above": lambda: bad_metadata(world, loc=9 * PAGE + n), "slot negative": lambda: bad_metadata(world, loc=-1 - n),
              "slot unmapped": lambda: bad_metadata(world, loc=8 * PAGE + n % PAGE), "page id": lambda: bad_metadata(world, page=9 + n)}[kind]()  # fmt: skip
        expect_refused(world, call, error, names)
        expect_refused(world, lambda: runner.run(x, md), error, names)

    check()


@pytest.mark.parametrize("name", ["cpu", "npu"])
def test_strided_and_stride_zero_inputs_compute_like_contiguous_ones(backends: dict[str, Any], name: str) -> None:
    """Not bad input: a strided or broadcast (stride-0) q/k/v is attended and written as its values say."""
    world, twin = World.build(backends[name]), World.build(backends[name])
    wide = torch.cat([world.q, world.q], dim=-1)[..., :D]
    k0 = world.k[:1].expand(2, 2, D)
    got = world.forward_swa(q=wide, k=k0)
    expect = twin.forward_swa(q=wide.contiguous(), k=k0.contiguous())
    assert torch.equal(got, expect)
    assert all(torch.equal(a, b) for a, b in zip(world.snapshot(), twin.snapshot()))


@pytest.mark.parametrize("name", ["cpu", "npu", "cuda"])
def test_out_receives_the_result_on_every_backend(backends: dict[str, Any], name: str) -> None:
    """Not bad input: ``out`` (an engine's preallocated rows) gets what the call returns without
    it, and is what the call returns; the K/V writes are the same."""
    world, twin = World.build(backends[name]), World.build(backends[name])
    out = torch.full((2, HQ, D), float("nan"), dtype=world.q.dtype, device=world.q.device)
    got = world.forward_swa(out=out)
    expect = twin.forward_swa()
    assert got is out
    assert torch.equal(out, expect)
    assert all(torch.equal(a, b) for a, b in zip(world.snapshot(), twin.snapshot()))


def test_nan_in_inputs_is_computed_not_refused(backends: dict[str, Any]) -> None:
    """hal does not scan values (that would cost a device read per call): NaN in q propagates to the
    rows that read it, and a NaN in k is written and read like any value."""
    world = World.build(backends["cpu"])
    q = world.q.clone()
    q[0, 0, 0] = float("nan")
    out = world.forward_swa(q=q)
    assert torch.isnan(out[0, 0]).all() and not torch.isnan(out[1]).any()
