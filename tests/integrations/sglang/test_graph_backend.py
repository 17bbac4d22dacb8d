"""``HalGraphBackend``: SGLang's per-shape graph protocol on hal's graphs. On the CPU hal's graph
re-runs the captured function, so a replay must reflect the inputs as they are at replay time."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

import hal  # noqa: E402
from hal.errors import GraphError, UnsupportedConfigError  # noqa: E402
from hal.integrations.sglang.graph import HalGraphBackend  # noqa: E402
from hal.integrations.sglang.plugin import bound_to  # noqa: E402

from forward_batches import captured_by_hal_graphs, replayed  # noqa: E402


def make_backend(metadata: object = None) -> HalGraphBackend:
    """The graph backend as hal's platform hands it to SGLang (bound to its hal backend), under an
    attention backend that is not hal's."""
    runner = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(device="cpu", attn_backend=types.SimpleNamespace(forward_metadata=metadata)),
    )
    return bound_to(HalGraphBackend, hal.get_backend("cpu"))(runner)  # type: ignore[no-any-return]


def test_without_a_bound_backend_it_refuses() -> None:
    """The graph backend takes the backend hal's platform bound, and looks none up, not even the
    attention backend's."""
    runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(device="cpu", attn_backend=types.SimpleNamespace()))
    with pytest.raises(UnsupportedConfigError, match="SGLANG_PLATFORM=hal"):
        HalGraphBackend(runner)


def test_an_attention_backend_on_another_hal_backend_is_refused() -> None:
    npu = hal.get_backend("npu", emulate=True)
    attn = npu_verify_setup(npu)[0]
    runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(device="cpu", attn_backend=attn))
    with pytest.raises(UnsupportedConfigError, match="both come from the one hal backend"):
        bound_to(HalGraphBackend, hal.get_backend("cpu"))(runner)
    assert bound_to(HalGraphBackend, npu)(runner).can_run(None, "any") is False


def test_capture_then_replay_reads_the_static_inputs() -> None:
    backend = make_backend()
    static_input = torch.arange(4.0)
    warmups = []
    with backend.capture_session(stream=None):
        backend.capture_one("bs4", lambda: static_input * 2, post_warmup_hook=lambda: warmups.append(1))
    assert len(warmups) == 2 and backend.can_run(None, "bs4") and not backend.can_run(None, "bs8")
    static_input.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))  # what SGLang's runner does before a replay
    with backend.replay_session():
        out = backend.replay("bs4", static_forward_batch=None)
    assert out.tolist() == [10.0, 12.0, 14.0, 16.0]
    backend.cleanup()
    assert not backend.can_run(None, "bs4")


def test_memory_saver_is_refused() -> None:
    runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(device="cpu"))
    with pytest.raises(UnsupportedConfigError, match="memory-saver"):
        HalGraphBackend(runner, enable_memory_saver=True)


def test_replay_of_a_graph_with_host_arguments_needs_metadata() -> None:
    """A graph that recorded updatable kernel calls cannot replay without fresh metadata."""
    backend = make_backend(metadata=None)
    with backend.capture_session(stream=None):
        backend.capture_one("bs1", lambda: torch.zeros(1))
    backend.captured("bs1").captured_calls.append((object(), object()))
    with pytest.raises(GraphError, match="no metadata"):
        backend.replay("bs1", static_forward_batch=None)


def npu_verify_setup(npu: object) -> tuple:
    """The backend ``hal`` given the (emulated) Ascend backend: SGLang's pool stored in an Ascend
    pool, the FIA kernel, a verify layer, and ForwardBatch makers."""
    from hal.integrations.sglang.attention import HalAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    page, ctx, d = 16, 64, 128
    sgl_pool = MHATokenToKVPool(
        size=512, page_size=page, dtype=torch.bfloat16, head_num=2, head_dim=d, layer_num=1, device="cpu",
        enable_memory_saver=False, v_head_dim=d,
    )
    req_to_token = torch.zeros((4, ctx), dtype=torch.int32)
    for r in range(4):  # request r on pages 4r+1 .. 4r+4
        req_to_token[r] = torch.arange(ctx) + (4 * r + 1) * page
    runner = types.SimpleNamespace(
        device="cpu", req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=sgl_pool,
        model_config=types.SimpleNamespace(context_len=ctx),
    )
    attn = HalAttnBackend(runner, backend=npu)
    assert type(attn.pool).__module__.startswith("hal.backends.npu") and attn.hal_backend is npu
    gen = torch.Generator().manual_seed(0)
    full = req_to_token[:, :ctx].reshape(-1).long()
    attn.pool.set_kv(0, full, torch.randn((len(full), 2, d), generator=gen).bfloat16(), torch.randn((len(full), 2, d), generator=gen).bfloat16())
    layer = RadixAttention(num_heads=4, head_dim=d, scaling=d**-0.5, num_kv_heads=2, layer_id=0, v_head_dim=d)

    def verify_batch(prefix: list[int], n: int = 2) -> ForwardBatch:
        loc = torch.cat([req_to_token[r, p : p + n].long() for r, p in enumerate(prefix)])
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(prefix), input_ids=torch.zeros(len(loc), dtype=torch.long),
            req_pool_indices=torch.arange(len(prefix)), seq_lens=torch.tensor(prefix), out_cache_loc=loc, seq_lens_sum=sum(prefix),
        )
        fb.seq_lens_cpu = torch.tensor(prefix)
        fb.spec_info = types.SimpleNamespace(topk=1, num_tokens_per_req=n, draft_token_num=n)
        return fb

    def inputs(rows: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn((rows, h * d), generator=gen).bfloat16() for h in (4, 2, 2))

    return attn, layer, verify_batch, inputs


def test_npu_graph_replays_take_the_new_batchs_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture a verify step on the emulated Ascend backend, replay it for a batch with other
    lengths: the same output as the eager forward, because the replay hands FIA the new
    ``actual_seq_kvlen``. Without that hand-over the replay attends over the captured lengths."""
    import hal
    from hal.backends.npu.attention import NpuAttention

    npu = hal.get_backend("npu", emulate=True)
    attn, layer, verify_batch, inputs = npu_verify_setup(npu)
    static = inputs(4)
    captured_batch = verify_batch([10, 20])
    graphs = captured_by_hal_graphs(attn, captured_batch, lambda: attn.forward_extend(*static, layer, captured_batch), key="verify-2")
    assert graphs.captured("verify-2").captured_calls  # FIA recorded its host-side lengths

    def replay(prefix: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        new = inputs(4)
        batch = verify_batch(prefix)
        for buffer, value in zip(static, new):
            buffer.copy_(value)
        out = replayed(graphs, attn, batch, key="verify-2").clone()
        attn.init_forward_metadata(batch)
        return out, attn.forward_extend(*new, layer, batch)

    out, eager = replay([37, 5])
    assert torch.equal(out, eager)
    monkeypatch.setattr(NpuAttention, "updatable_params", lambda self, metadata, layer: {})
    stale, eager = replay([41, 9])
    assert (stale.float() - eager.float()).abs().max() > 0.1
