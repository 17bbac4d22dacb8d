"""What a backend supports, asked before anything is built; pools built from layer specs; one
backend object handed from the edge to the engines."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hal
from hal.backends.npu.attention import NpuAttention
from hal.errors import SpecError, UnsupportedConfigError
from hal.spec import KVPoolSpec, LayerSpec
from hal.speculative import GreedyDecoder, ModelSpec, MultiLayerEagleWorker, TinyConfig, TinyMiMo

SMALL = TinyConfig(num_layers=6, hidden_size=64, intermediate_size=64, vocab_size=64, num_mtp_layers=2)


def layer(i: int, *, kv: int = 1, dk: int = 192, dv: int = 128, window: int | None = None) -> LayerSpec:
    return LayerSpec(i, 4, kv, dk, dv, scaling=dk**-0.5, sliding_window=window, has_sinks=window is not None)


# -- pools built from layer specs ----------------------------------------------------------------


def test_a_hybrid_pool_from_full_and_sliding_window_layers() -> None:
    layers = [layer(0), layer(1, kv=2, window=8), layer(2, kv=2, window=8), layer(3)]
    spec = KVPoolSpec.for_layers(layers, 64, 16, torch.bfloat16, swa_size=32)
    assert (spec.num_layers, spec.kv_heads, spec.head_dim, spec.v_head_dim, spec.dtype) == (4, 1, 192, 128, torch.bfloat16)
    assert spec.swa is not None and spec.swa.layer_ids == (1, 2) and (spec.swa.size, spec.swa.kv_heads) == (32, 2)
    for lay in layers:  # every layer's sub-pool has its geometry
        assert spec.layer_dims(lay.layer_id) == (lay.num_kv_heads, lay.head_dim, lay.v_head_dim)


@pytest.mark.parametrize("window", [None, 8])
def test_layers_of_one_kind_make_one_pool(window: int | None) -> None:
    spec = KVPoolSpec.for_layers([layer(1, kv=2, window=window), layer(0, kv=2, window=window)], 32, 16)
    assert spec.swa is None and (spec.num_layers, spec.kv_heads) == (2, 2)


@pytest.mark.parametrize(
    ("layers", "names"),
    [
        ([layer(0), layer(2)], "layer ids must be 0..1, each once, got [0, 2]"),
        ([layer(0), layer(1, kv=2)], "full-attention layers share one sub-pool"),
        ([layer(0), layer(1, window=4), layer(2, dv=192, window=4)], "layer 2: (1, 192, 192)"),
    ],
)
def test_layers_that_cannot_share_a_pool_are_named(layers: list[LayerSpec], names: str) -> None:
    with pytest.raises(SpecError) as info:
        KVPoolSpec.for_layers(layers, 32, 16)
    assert names in str(info.value)


def test_model_spec_wants_layer_ids_in_order() -> None:
    with pytest.raises(SpecError, match=r"target_layers must be LayerSpecs with layer ids 0..1 in order, got \[1, 0\]"):
        ModelSpec(8, 8, 8, (layer(1), layer(0)))
    assert TinyMiMo(SMALL).spec.draft_layers == tuple(SMALL.mtp_layer_spec(k) for k in range(2))


# -- capabilities, without allocating ---------------------------------------------------------------


@pytest.fixture()
def npu() -> Any:
    yield hal.get_backend("npu", emulate=True)


def test_the_npu_kernel_answers_before_any_pool_exists(npu: Any) -> None:
    mimo_full = layer(0)
    assert npu.unsupported_reason(mimo_full, torch.bfloat16, 128, max_q_len=512) is None
    assert "float16/bfloat16" in npu.unsupported_reason(mimo_full, torch.float32, 128)
    # head dim 192: multi-token queries need pages that are a multiple of 128
    assert npu.unsupported_reason(mimo_full, torch.bfloat16, 16) is None
    assert "multiple of 128" in npu.unsupported_reason(mimo_full, torch.bfloat16, 16, max_q_len=4)
    assert npu.kv_dtype_for([mimo_full], 128) == torch.bfloat16
    assert hal.get_backend("cpu").kv_dtype_for([mimo_full], 16) == torch.float32
    with pytest.raises(UnsupportedConfigError, match=r"backend 'npu', layer 1: FIA v2 in TND needs \(qk, v\) head dims"):
        npu.kv_dtype_for([mimo_full, layer(1, dk=96, dv=96)], 128)
    # the kernel's own check is the same answer
    assert NpuAttention.unsupported_reason(mimo_full, torch.float32, 128) == npu.unsupported_reason(mimo_full, torch.float32, 128)


@pytest.mark.parametrize(
    ("device", "prefer", "expected"),
    [
        ("cpu", None, torch.float32),  # the reference's precision first on the host
        ("cpu", torch.bfloat16, torch.bfloat16),  # the model's dtype where the kernel takes it
        ("cpu", torch.float16, torch.float16),
        ("cuda", None, torch.bfloat16),  # accelerators put bfloat16 first
        ("cuda", torch.float32, torch.float32),  # a float32 model on cuda keeps float32 KV (its kernel takes it)
        ("npu", None, torch.bfloat16),
        ("npu", torch.float16, torch.float16),
        ("npu", torch.float32, torch.bfloat16),  # FIA v2 takes no float32: the backend's first choice
    ],
)
def test_kv_dtype_follows_the_model_then_the_backends_own_order(device: str, prefer: Any, expected: torch.dtype) -> None:
    backend = hal.get_backend(device, emulate=device != "cpu")
    assert backend.kv_dtype_for([layer(0), layer(1, kv=2, window=127)], backend.default_page_size, prefer=prefer) == expected
    with pytest.raises(SpecError, match=r"prefer must be one of .* got torch.int8"):
        backend.kv_dtype_for([layer(0)], backend.default_page_size, prefer=torch.int8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_engine_types_its_buffers_and_kv_from_the_model_dtype(dtype: torch.dtype) -> None:
    model = TinyMiMo(SMALL).to(dtype)
    assert model.spec.dtype == dtype  # the spec follows the weights, never a stale copy
    worker = MultiLayerEagleWorker(model, hal.get_backend("cpu"), num_steps=2, max_batch_size=2, max_seq_len=64, graph_batch_sizes=[2])
    assert worker.target_pool.spec.dtype == worker.mtp_pool.spec.dtype == dtype
    # the draft runners' hidden-state buffer is typed from the spec: a float32 buffer refused the
    # target's bf16 hidden states before (GraphError at the first verify)
    assert len(worker.generate([[1, 2, 3]], 6).tokens[0]) == 6


@pytest.mark.parametrize("device", ["cpu", "npu", "cuda"])
def test_every_default_page_size_runs_every_mode_of_the_mimo_layers(device: str) -> None:
    backend = hal.get_backend(device, emulate=device != "cpu")
    page = backend.default_page_size
    layers = [layer(0), layer(1, kv=2, window=127)]
    dtype = backend.kv_dtype_for(layers, page, max_q_len=4096, batch_size=64)
    for q in (1, 4, 4096):
        backend.check_layers(layers, dtype, page, max_q_len=q, batch_size=64)


def test_an_engine_refuses_a_layer_before_allocating(npu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[KVPoolSpec] = []
    original = type(npu).create_kv_pool
    monkeypatch.setattr(type(npu), "create_kv_pool", lambda self, spec: created.append(spec) or original(self, spec))
    model = TinyMiMo(SMALL)
    with pytest.raises(UnsupportedConfigError, match=r"layer 0: .*page size that is a multiple of 128 .* the pool has 16"):
        GreedyDecoder(model, npu, page_size=16, max_batch_size=2, max_seq_len=64)
    with pytest.raises(UnsupportedConfigError, match="float16/bfloat16"):
        MultiLayerEagleWorker(model, npu, num_steps=2, kv_dtype=torch.float32, max_batch_size=2, max_seq_len=64)
    assert created == []
    # kv_dtype left to the backend: bfloat16 for FIA v2, on its default pages
    worker = MultiLayerEagleWorker(model, npu, num_steps=2, max_batch_size=2, max_seq_len=64, graph_batch_sizes=[2])
    assert [spec.dtype for spec in created] == [torch.bfloat16] * 2 and {spec.page_size for spec in created} == {128}
    assert worker.mtp_pool.spec.num_layers == 2 and worker.mtp_pool.spec.kv_heads == SMALL.swa_kv_heads


# -- one backend object, from the edge inward -------------------------------------------------------


def test_engines_use_the_backend_they_are_handed(npu: Any) -> None:
    model = TinyMiMo(SMALL)
    decoder = GreedyDecoder(model, npu, max_batch_size=1, max_seq_len=64, graph_batch_sizes=[1])
    assert decoder.backend is npu and isinstance(decoder.target_attention, NpuAttention)
    with pytest.raises(SpecError, match=r"backend must be a hal.Backend, got str 'npu': resolve it once at the edge, hal.get_backend\('npu'\)"):
        GreedyDecoder(model, "npu")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="backend must be a hal.Backend, got int 3"):
        GreedyDecoder(model, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="emulate"):
        GreedyDecoder(model, npu, emulate=True)  # type: ignore[call-arg]


def test_a_rank_takes_its_device_from_the_backend(npu: Any) -> None:
    cpu = hal.get_backend("cpu")
    assert cpu.for_rank(3) is cpu  # host memory: every rank shares it
    assert npu.for_rank(0) is npu
    second = npu.for_rank(1)
    assert type(second) is type(npu) and second.index == 1
    with pytest.raises(SpecError, match="local_rank must be an int >= 0, got -1"):
        npu.for_rank(-1)
