"""The NPU backend (backends/npu) through the torch_npu emulator: registry and availability,
agreement with the oracle for every mode and feature, the KV pool, and NPUGraph capture
driven by the device-neutral GraphRunner."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hal
from hal.backends.cpu import CpuBackend
from hal.backends.npu import NpuBackend, emulator
from hal.backends.npu.attention import NpuAttention
from hal.backends.npu.graph import NpuGraph
from hal.backends.npu.kv_pool import NpuKVPool
from hal.backends.npu.kv_pool import BUFFER_ALIGNMENT
from hal import (
    ForwardMode,
    GraphRunner,
    KVAllocator,
    KVPoolSpec,
    LayerSpec,
    RequestPageTable,
    SWAPoolSpec,
    build_metadata,
)
from hal.errors import BackendUnavailableError, CacheLocationError, GraphError, SpecError, UnsupportedConfigError
from hal.graph import GraphUpdate, is_capturing
from hal.tools.conformance import tree_cases
from hal.tools.testing import AttentionCase, prepare_case, run_attention_case, standard_attention_cases
from hal.tree import tree_mask_from_parents

BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture
def npu() -> Iterator[NpuBackend]:
    be = hal.get_backend("npu", emulate=True)
    assert isinstance(be, NpuBackend)
    yield be


# ------------------------------------------------------------------------------ registry
def test_npu_is_unavailable_without_torch_npu_and_says_how_to_install() -> None:
    assert not emulator.is_installed()
    assert NpuBackend.probe() == hal.Availability(False, "torch_npu is not installed")
    assert not NpuBackend.is_available()
    with pytest.raises(BackendUnavailableError, match=r"torch_npu is not installed; install the Ascend extra \(pip install"):
        hal.get_backend("npu")
    with pytest.raises(BackendUnavailableError, match="torch_npu is not installed"):
        hal.get_backend("npu:1")


def test_importing_hal_and_the_npu_backend_imports_no_torch_npu() -> None:
    code = textwrap.dedent(
        """
        import sys, hal, hal.backends.npu, hal.backends.npu.emulator
        hal.get_backend("cpu")
        assert "torch_npu" not in sys.modules and not hasattr(__import__("torch"), "npu"), sys.modules.keys()
        try:
            hal.get_backend("npu")
        except hal.BackendUnavailableError:
            pass
        else:
            raise SystemExit("npu available without torch_npu")
        assert "torch_npu" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_emulated_backend_is_the_npu_bundle(npu: NpuBackend) -> None:
    assert (npu.name, npu.device_type, npu.collective_backend) == ("npu", "npu", "hccl")
    assert npu.device == torch.device("cpu")  # the emulator keeps tensors on the host
    assert npu.emulated and not NpuBackend.probe().available  # the emulator is this instance's only
    info = NpuBackend.probe_emulation()
    assert info.available and info.device_count == 1 and "emulator" in info.reason
    assert info.versions["torch_npu"] == "emulator"
    assert isinstance(npu, hal.Backend)
    pool = npu.create_kv_pool(KVPoolSpec(1, 32, 16, 1, 128, 128, BF16))
    assert isinstance(pool, NpuKVPool) and isinstance(pool, hal.KVPool)
    assert isinstance(npu.create_attention(pool), hal.AttentionKernel)
    assert isinstance(npu.create_graph(), hal.Graph)
    assert npu.graph_memory_pool() == npu.graph_memory_pool()
    with pytest.raises(BackendUnavailableError, match="does not exist"):
        hal.get_backend("npu:3", emulate=True)


def test_emulation_installs_nothing_in_the_process() -> None:
    """An emulated backend that has captured, replayed and attended leaves no torch_npu in
    sys.modules and no torch.npu, so transformers (and any engine) still sees a machine without
    Ascend; a plain lookup still finds no NPU."""
    code = textwrap.dedent(
        """
        import sys, torch, hal
        from hal.tools.conformance import Status, build_suite, run_suite
        npu = hal.get_backend("npu", emulate=True)
        results = run_suite(npu, build_suite(quick=True, select=["decode", "graph"]))
        assert results and all(r.status is not Status.FAILED for r in results), [r for r in results if r.status is Status.FAILED]
        assert sum(r.status is Status.PASSED for r in results) > 5
        assert "torch_npu" not in sys.modules and not hasattr(torch, "npu"), "emulation leaked into the process"
        import transformers.utils
        assert not transformers.utils.is_torch_npu_available()
        try:
            hal.get_backend("npu")
        except hal.BackendUnavailableError as exc:
            assert "torch_npu is not installed" in str(exc), exc
        else:
            raise SystemExit("a plain npu lookup found the emulator")
        assert hal.get_backend("npu", emulate=True) is npu
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# ------------------------------------------------------------------------------ attention vs CPU
def conformance_cases() -> list[AttentionCase]:
    cases = standard_attention_cases(
        dtypes=(BF16, FP16), page_sizes=(16, 64), head_dims=((128, 128),), heads=((4, 1), (4, 4)), seed=1
    )
    cases += standard_attention_cases(
        dtypes=(BF16, FP16), page_sizes=(128,), head_dims=((192, 128),), heads=((8, 2),), seed=2
    )
    # qk 192 on a 16-token page is legal for single-token queries (decode)
    cases += [
        c
        for c in standard_attention_cases(dtypes=(BF16,), page_sizes=(16,), head_dims=((192, 128),), heads=((4, 1),), seed=3)
        if c.mode is ForwardMode.DECODE
    ]
    return cases


CASES = conformance_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.describe() for c in CASES])
def test_attention_matches_the_cpu_reference(npu: NpuBackend, case: AttentionCase) -> None:
    result = run_attention_case(npu, case)
    assert result.passed, result.detail


FIA_TREE_CASES = [c for c in tree_cases() if c.dtype != torch.float32 and c.layer.head_dim in (128, 192)]


@pytest.mark.parametrize("case", FIA_TREE_CASES, ids=[c.describe() for c in FIA_TREE_CASES])
def test_tree_verify_matches_the_oracle_through_an_explicit_mask(npu: NpuBackend, case: AttentionCase) -> None:
    result = run_attention_case(npu, case)
    assert result.passed, result.detail
    assert run_attention_case(npu, case, poison_unseen=True).passed


def test_conformance_cases_cover_every_mode_and_feature() -> None:
    assert {c.mode for c in CASES} == {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2}
    assert {c.dtype for c in CASES} == {BF16, FP16}
    assert {(c.layer.head_dim, c.layer.v_head_dim, c.page_size) for c in CASES} >= {(128, 128, 16), (128, 128, 64), (192, 128, 128)}
    assert any(c.hybrid for c in CASES) and any(c.layer.has_sinks for c in CASES)
    assert any(c.layer.is_swa and not c.hybrid for c in CASES) and any(c.layer.group_size > 1 for c in CASES)


UNSUPPORTED = [
    (AttentionCase(ForwardMode.EXTEND, LayerSpec(0, 4, 1, 128, 128, 0.1), (20,), (5,), 16, torch.float32), "float16/bfloat16"),
    (AttentionCase(ForwardMode.DECODE, LayerSpec(0, 4, 1, 64, 64, 0.1), (20,), (1,), 16, BF16), "head dims"),
    (AttentionCase(ForwardMode.DECODE, LayerSpec(0, 4, 1, 128, 64, 0.1), (20,), (1,), 16, BF16), "head dims"),
    (AttentionCase(ForwardMode.EXTEND, LayerSpec(0, 4, 1, 192, 128, 0.1), (70,), (6,), 64, BF16), "multiple of 128"),
    (
        AttentionCase(ForwardMode.DECODE, LayerSpec(0, 4, 1, 192, 192, 0.1, 8, has_sinks=True), (20,), (1,), 128, BF16),
        "v head dim <= 128",
    ),
    (AttentionCase(ForwardMode.DECODE, LayerSpec(0, 128, 1, 128, 128, 0.1), (20,), (1,), 16, BF16), "q/kv heads <= 64"),
    # Documented for paged KV: "GQA and PA do not support V_D = 192" (MiMo's 192/128 is allowed).
    (AttentionCase(ForwardMode.DECODE, LayerSpec(0, 4, 2, 192, 192, 0.1), (20,), (1,), 128, BF16), "v head dim 192"),
    (AttentionCase(ForwardMode.EXTEND, LayerSpec(0, 4, 1, 192, 192, 0.1, 5), (20,), (6,), 128, BF16), "v head dim 192"),
]


@pytest.mark.parametrize("case, reason", UNSUPPORTED, ids=[c.describe() for c, _ in UNSUPPORTED])
def test_unsupported_configs_raise_before_touching_the_cache(npu: NpuBackend, case: AttentionCase, reason: str) -> None:
    got, _ = prepare_case(npu, case)
    k_before, v_before = got.pool.k_buffer(0).clone(), got.pool.v_buffer(0).clone()
    with pytest.raises(UnsupportedConfigError, match=reason):
        got.kernel.forward(got.q, got.k, got.v, case.layer, got.kernel.plan(got.metadata), sinks=got.sinks)
    assert torch.equal(got.pool.k_buffer(0), k_before) and torch.equal(got.pool.v_buffer(0), v_before)
    with pytest.raises(UnsupportedConfigError):
        run_attention_case(npu, case)


def test_bad_query_shape_is_a_spec_error(npu: NpuBackend) -> None:
    case = AttentionCase(ForwardMode.DECODE, LayerSpec(0, 4, 1, 128, 128, 0.1), (20,), (1,), 16, BF16)
    got, _ = prepare_case(npu, case)
    with pytest.raises(SpecError, match="q has shape"):
        got.kernel.forward(got.q[:, :2], got.k, got.v, case.layer, got.kernel.plan(got.metadata))


def test_fia_call_uses_the_documented_arguments(npu: NpuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    real = emulator.FIA_V2

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        calls.append({"q": q, "k": k, "v": v, **kwargs})
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(npu.runtime.torch_npu, "npu_fused_infer_attention_score_v2", spy)
    swa = LayerSpec(0, 4, 2, 192, 128, 0.1, sliding_window=7, has_sinks=True)
    case = AttentionCase(ForwardMode.TARGET_VERIFY, swa, (140, 9), (4, 4), 128, BF16, hybrid=True)
    assert run_attention_case(npu, case).passed
    call = calls[0]
    assert call["input_layout"] == "TND" and call["block_size"] == 128
    assert call["actual_seq_qlen"] == [4, 8] and call["actual_seq_kvlen"] == [140, 9]
    assert (call["sparse_mode"], call["pre_tokens"], call["next_tokens"]) == (4, 7, 0)
    assert (call["num_query_heads"], call["num_key_value_heads"]) == (4, 2)
    assert call["k"].shape[1:] == (128, 2 * 192) and call["v"].shape[1:] == (128, 2 * 128)
    assert call["learnable_sink"].dtype == BF16 and call["block_table"].dtype == torch.int32
    got, _ = prepare_case(npu, case)
    assert torch.equal(call["block_table"], got.metadata.swa_block_table)  # the SWA sub-pool's pages
    full = AttentionCase(ForwardMode.EXTEND, LayerSpec(0, 4, 4, 128, 128, 0.1), (30,), (10,), 16, FP16)
    assert run_attention_case(npu, full).passed
    assert calls[-1]["sparse_mode"] == 3 and calls[-1]["atten_mask"].shape == (2048, 2048)


# ------------------------------------------------------------------------------ KV pool
def write_both(spec: KVPoolSpec, npu: NpuBackend) -> tuple[NpuKVPool, Any]:
    pools = (npu.create_kv_pool(spec), CpuBackend().create_kv_pool(spec))
    g = torch.Generator().manual_seed(0)
    pages = torch.randperm(spec.num_pages, generator=g)[: spec.num_pages // 2] + 1
    for pool in pools:
        if spec.swa is not None:
            pool.map_swa_pages(pages, torch.arange(1, pages.numel() + 1))
    slots = (pages[:, None] * spec.page_size + torch.arange(spec.page_size)).reshape(-1)
    slots = slots[torch.randperm(slots.numel(), generator=g)][:50]
    for layer in range(spec.num_layers):
        heads, dk, dv = spec.layer_dims(layer)
        k = torch.randn(50, heads, dk, generator=g).to(spec.dtype)
        v = torch.randn(50, heads, dv, generator=g).to(spec.dtype)
        for pool in pools:
            pool.set_kv(layer, slots, k, v)
    return pools


def test_scatter_writes_match_the_cpu_pool_for_k_and_v_with_their_own_head_dims(npu: NpuBackend) -> None:
    plain = KVPoolSpec(2, 20 * 16, 16, 2, 192, 128, BF16)
    hybrid = KVPoolSpec(3, 20 * 16, 16, 2, 192, 128, FP16, SWAPoolSpec((1,), 12 * 16, 4, 128, 64))
    for spec in (plain, hybrid):
        got, ref = write_both(spec, npu)
        for layer in range(spec.num_layers):
            assert got.v_buffer(layer).shape[-1] == spec.layer_dims(layer)[2]
            assert torch.equal(got.k_buffer(layer), ref.k_buffer(layer)), layer
            assert torch.equal(got.v_buffer(layer), ref.v_buffer(layer)), layer
            assert got.k_buffer(layer).abs().sum() > 0 and got.v_buffer(layer).abs().sum() > 0


def test_pool_buffers_are_aligned_separate_and_layer_views_are_not_copies(npu: NpuBackend) -> None:
    spec = KVPoolSpec(3, 8 * 16, 16, 1, 192, 128, BF16, SWAPoolSpec((0, 2), 4 * 16, 2, 128, 128))
    pool = npu.create_kv_pool(spec)
    buffers = [t for pair in pool.sub_pool_buffers().values() for t in pair]
    assert len(buffers) == 4 and len({t.untyped_storage().data_ptr() for t in buffers}) == 4
    assert all(t.data_ptr() % BUFFER_ALIGNMENT == 0 and t.is_contiguous() for t in buffers)
    for layer in range(3):
        k_sub, v_sub = pool.sub_pool_buffers()["swa" if pool.is_swa_layer(layer) else "full"]
        assert pool.k_buffer(layer).untyped_storage().data_ptr() == k_sub.untyped_storage().data_ptr()
        assert pool.v_buffer(layer).untyped_storage().data_ptr() == v_sub.untyped_storage().data_ptr()


def test_out_of_range_writes_raise_and_write_nothing(npu: NpuBackend) -> None:
    pool = npu.create_kv_pool(KVPoolSpec(1, 4 * 16, 16, 1, 128, 128, BF16))
    k = torch.ones(2, 1, 128, dtype=BF16)
    with pytest.raises(CacheLocationError, match="out of range"):
        pool.set_kv(0, torch.tensor([3, 5 * 16]), k, k)
    assert pool.k_buffer(0).abs().sum() == 0 and pool.v_buffer(0).abs().sum() == 0


# ------------------------------------------------------------------------------ graphs
TPR = {ForwardMode.DECODE: 1, ForwardMode.TARGET_VERIFY: 4, ForwardMode.DRAFT_EXTEND_V2: 4}


class TwoLayerForward:
    """A full layer and an SWA layer with sinks (hybrid pool): two captured FIA calls per graph."""

    def __init__(self, npu: NpuBackend, page_size: int = 16) -> None:
        self.full = LayerSpec(0, 4, 1, 128, 128, 128**-0.5)
        self.swa = LayerSpec(1, 4, 2, 128, 128, 128**-0.5, sliding_window=6, has_sinks=True)
        spec = KVPoolSpec(2, 48 * page_size, page_size, 1, 128, 128, BF16, SWAPoolSpec((1,), 48 * page_size, 2, 128, 128))
        self.pool = npu.create_kv_pool(spec)
        self.attn = npu.create_attention(self.pool)
        self.sinks = torch.randn(4, generator=torch.Generator().manual_seed(5))
        allocator = KVAllocator(self.pool)
        assert allocator.swa is not None
        allocator.swa.alloc(5)  # full page p is backed by SWA page p + 5: the two block tables differ
        self.table = RequestPageTable(allocator)
        self.inputs = {
            "q0": ((4, 128), BF16), "k0": ((1, 128), BF16), "v0": ((1, 128), BF16),
            "q1": ((4, 128), BF16), "k1": ((2, 128), BF16), "v1": ((2, 128), BF16),
        }  # fmt: skip
        self.gen = torch.Generator().manual_seed(6)

    def __call__(self, x: dict[str, torch.Tensor], md: hal.AttentionMetadata, attn: Any = None) -> torch.Tensor:
        attn = self.attn if attn is None else attn
        a = attn.forward(x["q0"], x["k0"], x["v0"], self.full, attn.plan(md))
        b = attn.forward(x["q1"], x["k1"], x["v1"], self.swa, attn.plan(md), sinks=self.sinks)
        return torch.cat([a, b], dim=-1)

    def batch(
        self, mode: ForwardMode, kv_lens: dict[int, int], trees: bool = False
    ) -> tuple[dict[str, torch.Tensor], hal.AttentionMetadata]:
        tpr = TPR[mode]
        reqs = list(kv_lens)
        for r in reqs:
            self.table.reserve(r, kv_lens[r])
        loc = torch.cat([self.table.slots(r, range(kv_lens[r] - tpr, kv_lens[r])) for r in reqs])
        parents = [[-1] + [int(torch.randint(0, i, (1,), generator=self.gen)) for i in range(1, tpr)] for _ in reqs]
        md = build_metadata(
            mode, kv_lens=[kv_lens[r] for r in reqs], q_lens=[tpr] * len(reqs), page_table=self.table.table(reqs),
            out_cache_loc=loc, pool=self.pool, tree_mask=tree_mask_from_parents(parents) if trees else None,
        )  # fmt: skip
        t = tpr * len(reqs)
        x = {n: torch.randn(t, *shape, generator=self.gen).to(dtype) for n, (shape, dtype) in self.inputs.items()}
        return x, md


def runner_for(npu: NpuBackend, model: TwoLayerForward, mode: ForwardMode, trees: bool = False) -> GraphRunner:
    runner = GraphRunner(
        npu, model, attention=model.attn, mode=mode, tokens_per_request=TPR[mode], batch_sizes=[1, 2, 4],
        max_pages_per_request=8, inputs=model.inputs, trees=trees,
    )  # fmt: skip
    runner.capture()
    return runner


def recorded_updates(monkeypatch: pytest.MonkeyPatch) -> list[list[dict[str, Any]]]:
    """Every ``NPUGraph.update`` input from now on, in order (the update still applies)."""
    updates: list[list[dict[str, Any]]] = []
    real_update = emulator.NPUGraph.update

    def spy(self: Any, cpu_update_input: Any) -> None:
        updates.append(cpu_update_input)
        real_update(self, cpu_update_input)

    monkeypatch.setattr(emulator.NPUGraph, "update", spy)
    return updates


SCHEDULE = [{0: 9, 1: 30}, {0: 12, 1: 33, 2: 5, 3: 17}, {2: 40}, {0: 15, 1: 36, 2: 43}, {0: 70, 1: 39, 2: 46, 3: 20, 4: 8}]


@pytest.mark.parametrize("mode", list(TPR), ids=[m.name for m in TPR])
def test_graph_runner_replays_match_eager_with_changing_kv_lens(
    npu: NpuBackend, mode: ForwardMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = TwoLayerForward(npu)
    runner = runner_for(npu, model, mode)
    updates = recorded_updates(monkeypatch)
    for lens in SCHEDULE:  # batches 2, 4, 1, 3 replay graphs 2, 4, 1, 4; 5 runs eagerly
        x, md = model.batch(mode, lens)
        out = runner.run(x, md).clone()
        ref = model(x, md)
        assert torch.equal(out, ref), lens
        cpu_ref = model(x, md, CpuBackend().create_attention(model.pool))
        torch.testing.assert_close(out.float(), cpu_ref.float(), atol=1.6e-2, rtol=1.6e-2)
    assert not torch.equal(md.block_table, md.swa_block_table)
    assert len(updates) == 4  # one per replay; the batch of 5 ran eagerly
    last = updates[-1]  # batch of 3 padded to 4: kv_len of the padding request = fill + q_len - 1
    assert len(last) == 2 and last[0] == last[1]
    assert last[0]["actual_seq_kvlen"] == [15, 36, 43, TPR[mode]]
    assert last[0]["actual_seq_qlen"] == [TPR[mode] * (i + 1) for i in range(4)]


def test_graph_runner_replays_tree_batches_match_eager_with_changing_trees(
    npu: NpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify batches over draft trees: each replay takes its batch's trees into the captured mask
    tensor (the FIA mask is re-derived inside the graph) and its lengths through the update (BSND:
    per-request query lengths)."""
    model = TwoLayerForward(npu, page_size=16)
    runner = runner_for(npu, model, ForwardMode.TARGET_VERIFY, trees=True)
    updates = recorded_updates(monkeypatch)
    for lens in SCHEDULE:
        x, md = model.batch(ForwardMode.TARGET_VERIFY, lens, trees=True)
        out = runner.run(x, md).clone()
        assert torch.equal(out, model(x, md)), lens
        cpu_ref = model(x, md, CpuBackend().create_attention(model.pool))
        torch.testing.assert_close(out.float(), cpu_ref.float(), atol=1.6e-2, rtol=1.6e-2)
    assert len(updates) == 4 and updates[-1][0]["actual_seq_qlen"] == [4, 4, 4, 4]
    x, md = model.batch(ForwardMode.TARGET_VERIFY, {0: 80})
    with pytest.raises(SpecError, match="trees=True got a verify batch without a tree_mask"):
        runner.run(x, md)


def test_without_the_host_update_replays_use_stale_lengths(npu: NpuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    model = TwoLayerForward(npu)
    runner = runner_for(npu, model, ForwardMode.TARGET_VERIFY)
    monkeypatch.setattr(NpuAttention, "updatable_params", lambda self, md, layer: {})
    x, md = model.batch(ForwardMode.TARGET_VERIFY, {0: 20, 1: 33})
    out = runner.run(x, md).clone()
    ref = model(x, md)
    assert (out.float() - ref.float()).abs().max() > 0.1  # attention over the capture-time lengths


def test_an_update_thread_exception_surfaces_from_replay(npu: NpuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    model = TwoLayerForward(npu)
    runner = runner_for(npu, model, ForwardMode.DECODE)
    x, md = model.batch(ForwardMode.DECODE, {0: 9})

    def broken(self: Any, cpu_update_input: Any) -> None:
        raise ValueError("injected update failure")

    monkeypatch.setattr(emulator.runtime, "REPLAY_WAIT_TIMEOUT_S", 0.2)  # nothing releases the replay now
    monkeypatch.setattr(emulator.NPUGraph, "update", broken)
    with pytest.raises(GraphError, match="injected update failure") as info:
        runner.run(x, md)
    assert isinstance(info.value.__cause__, ValueError)
    monkeypatch.undo()  # the update works again: the same graph replays correctly
    x, md = model.batch(ForwardMode.DECODE, {0: 11})
    torch.testing.assert_close(runner.run(x, md).float(), model(x, md).float(), atol=0, rtol=0)


def test_per_request_query_lengths_are_rejected_on_update(npu: NpuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    model = TwoLayerForward(npu)
    runner = runner_for(npu, model, ForwardMode.TARGET_VERIFY)
    x, md = model.batch(ForwardMode.TARGET_VERIFY, {0: 20, 1: 33})

    def per_request(self: Any, md: hal.AttentionMetadata, layer: LayerSpec) -> dict[str, list[int]]:
        return {"actual_seq_qlen": list(md.q_lens_cpu), "actual_seq_kvlen": list(md.kv_lens_cpu)}

    monkeypatch.setattr(NpuAttention, "updatable_params", per_request)
    with pytest.raises(GraphError, match="TND actual_seq_qlen") as info:
        runner.run(x, md)
    assert isinstance(info.value.__cause__, emulator.NpuOpError)


def test_graph_warms_up_barriers_on_the_tp_group_then_captures(npu: NpuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    tp_group = object()

    def barrier(group: Any = None) -> None:
        events.append("barrier" if group is tp_group else f"barrier on {group!r}")

    monkeypatch.setattr(torch.distributed, "barrier", barrier)
    graph = NpuGraph(npu.runtime, tp_group=tp_group, warmup_runs=2)
    x = torch.ones(3)

    def fn() -> torch.Tensor:
        events.append("capture" if is_capturing() else "warm-up")
        return x * 3

    y = graph.capture(fn)
    assert events == ["warm-up", "warm-up", "barrier", "capture"]
    x.fill_(2)
    graph.replay()
    assert torch.equal(y, torch.full((3,), 6.0))
    assert graph.captured_calls == []


def test_graph_misuse_raises(npu: NpuBackend) -> None:
    graph = npu.create_graph()
    with pytest.raises(GraphError, match="capture\\(\\) first"):
        graph.replay()
    model = TwoLayerForward(npu)
    x, md = model.batch(ForwardMode.DECODE, {0: 5})
    graph.capture(lambda: model(x, md))
    assert [layer.layer_id for _, layer in graph.captured_calls] == [0, 1]
    with pytest.raises(GraphError, match="already captured"):
        graph.capture(lambda: None)
    with pytest.raises(GraphError, match="3 host-parameter dicts, the graph captured 2"):
        graph.replay(GraphUpdate(host_params=({}, {}, {})))
    graph.replay(GraphUpdate(host_params=tuple(model.attn.updatable_params(md, layer) for _, layer in graph.captured_calls)))
