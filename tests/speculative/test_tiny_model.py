"""The tiny MiMo-V2-style model: structure, init, RoPE, and its KV-cached forward against a dense one."""

from __future__ import annotations

import pytest
import torch

import hal
from hal import ForwardMode, KVPoolSpec, SWAPoolSpec
from hal.errors import SpecError
from hal.speculative.distill import DenseAttend
from hal.speculative.layers import PartialRotary
from hal.speculative.model import TinyConfig, TinyMiMo
from hal.speculative.engine import KernelAttend

# Default head dims (192/128) and window; fewer layers so the tests stay fast (0 and 5 are full).
SIX = TinyConfig(num_layers=6, vocab_size=256)


def test_hybrid_pattern_follows_mimo_v2() -> None:
    assert TinyConfig().full_layer_ids == (0, 5, 11, 17)
    assert TinyConfig(num_layers=12).full_layer_ids == (0, 5, 11)
    assert TinyConfig(num_layers=48).full_layer_ids == (0, 5, 11, 17, 23, 29, 35, 41, 47)
    cfg = TinyConfig(num_layers=12)
    assert set(cfg.full_layer_ids) | set(cfg.swa_layer_ids) == set(range(12))
    assert not set(cfg.full_layer_ids) & set(cfg.swa_layer_ids)


def test_layer_specs_full_vs_swa() -> None:
    cfg = TinyConfig()
    model = TinyMiMo(cfg)
    for i, layer in enumerate(model.layers):
        spec = layer.attn.spec
        assert spec.layer_id == i
        assert (spec.head_dim, spec.v_head_dim) == (192, 128)  # qk != v, FIA-legal in TND
        if i in cfg.full_layer_ids:
            assert spec.sliding_window is None and not spec.has_sinks and layer.attn.sinks is None
            assert spec.num_kv_heads == cfg.full_kv_heads
        else:
            assert spec.sliding_window == cfg.sliding_window and spec.has_sinks
            assert layer.attn.sinks is not None and layer.attn.sinks.shape == (cfg.num_q_heads,)
            assert spec.num_kv_heads == cfg.swa_kv_heads
    assert cfg.full_kv_heads != cfg.swa_kv_heads  # GQA with different KV-head counts
    for k, block in enumerate(model.mtp):
        spec = block.layer.attn.spec
        assert spec.layer_id == k and spec.is_swa and spec.has_sinks and spec.num_kv_heads == cfg.swa_kv_heads
        assert block.eh_proj.in_features == 2 * cfg.hidden_size


def test_bad_config_raises() -> None:
    with pytest.raises(SpecError, match="swa_kv_heads"):
        TinyConfig(num_q_heads=4, swa_kv_heads=3)
    with pytest.raises(SpecError, match="rope_dim"):
        TinyConfig(rope_dim=200)
    with pytest.raises(SpecError, match="hidden_size"):
        TinyConfig(hidden_size=0)


def test_init_is_deterministic_in_the_seed() -> None:
    a, b, c = TinyMiMo(SIX), TinyMiMo(SIX), TinyMiMo(TinyConfig(num_layers=6, vocab_size=256, seed=1))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def test_partial_rope_rotates_only_the_first_dims() -> None:
    rope = PartialRotary(rope_dim=64, theta=10_000.0, max_position=64)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 192, generator=gen)
    k = torch.randn(5, 3, 192, generator=gen)
    pos = torch.tensor([0, 3, 7, 20, 63])
    rq = rope(q, pos)
    assert torch.equal(rq[..., 64:], q[..., 64:])  # the non-rotary dims pass through
    assert torch.allclose(rq[0], q[0])  # position 0 is the identity
    # Rotation: each (i, i + 32) pair keeps its norm.
    pair_norm = lambda x: x[..., :32] ** 2 + x[..., 32:64] ** 2  # noqa: E731
    assert torch.allclose(pair_norm(rq), pair_norm(q), atol=1e-4)
    # Relative: q(p) . k(p') on the rotary dims depends only on p - p'.
    dot = lambda a, pa, b, pb: (rope(a, pa)[..., :64] * rope(b, pb)[..., :64]).sum(-1)  # noqa: E731
    one, six = torch.tensor([1]), torch.tensor([6])
    assert torch.allclose(dot(q[:1], six, k[:1], one), dot(q[:1], six + 10, k[:1], one + 10), atol=1e-4)


def _hal_cache(cfg: TinyConfig, page_size: int, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    backend = hal.get_backend("cpu")
    size = 8 * page_size
    swa = SWAPoolSpec(cfg.swa_layer_ids, size, cfg.swa_kv_heads, cfg.qk_head_dim, cfg.v_head_dim)
    pool = backend.create_kv_pool(
        KVPoolSpec(cfg.num_layers, size, page_size, cfg.full_kv_heads, cfg.qk_head_dim, cfg.v_head_dim, dtype, swa)
    )
    table = hal.RequestPageTable(hal.KVAllocator(pool))
    return pool, backend.create_attention(pool), table


def _cached_forward(model, kernel, pool, table, tokens, start, mode):  # type: ignore[no-untyped-def]
    """Run ``tokens`` at positions ``start ..`` of request 0 through the hal kernel."""
    end = start + len(tokens)
    table.reserve(0, end)
    md = hal.build_metadata(
        mode, kv_lens=[end], q_lens=[len(tokens)], page_table=table.table([0]),
        out_cache_loc=table.slots(0, range(start, end)), pool=pool,
    )
    return model.target_hidden(torch.tensor(tokens), md.positions, KernelAttend(kernel, md))


@pytest.mark.parametrize("page_size", [16, 64])
def test_kv_cached_forward_matches_a_dense_forward(page_size: int) -> None:
    """Prefill, a verify-shaped chunk and single-token decodes through the paged hybrid cache give the
    hidden states of one dense causal forward over the whole sequence (windows and sinks included)."""
    model = TinyMiMo(SIX).eval()
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(0, SIX.vocab_size, (45,), generator=gen).tolist()  # > 2 windows, crosses pages
    pool, kernel, table = _hal_cache(SIX, page_size)
    with torch.no_grad():
        dense = model.target_hidden(torch.tensor(seq), torch.arange(len(seq)), DenseAttend(1, len(seq)))
        parts = [_cached_forward(model, kernel, pool, table, seq[:30], 0, ForwardMode.EXTEND)]
        parts.append(_cached_forward(model, kernel, pool, table, seq[30:34], 30, ForwardMode.TARGET_VERIFY))
        for p in range(34, len(seq)):
            parts.append(_cached_forward(model, kernel, pool, table, seq[p : p + 1], p, ForwardMode.DECODE))
    cached = torch.cat(parts)
    assert torch.allclose(cached, dense, atol=1e-4, rtol=1e-4), float((cached - dense).abs().max())


def test_bf16_kv_cache_stays_close_to_fp32() -> None:
    """``KernelAttend`` casts q/k/v and sinks to the pool dtype and the output back to fp32."""
    model = TinyMiMo(SIX).eval()
    seq = list(range(3, 40))
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        pool, kernel, table = _hal_cache(SIX, 16, dtype)
        with torch.no_grad():
            outs.append(_cached_forward(model, kernel, pool, table, seq, 0, ForwardMode.EXTEND))
        assert pool.k_buffer(1).dtype == dtype
    assert outs[1].dtype == torch.float32
    assert torch.allclose(outs[0], outs[1], atol=0.1), float((outs[0] - outs[1]).abs().max())
    assert not torch.equal(outs[0], outs[1])  # bf16 really was used


def test_mtp_block_sees_exactly_its_window() -> None:
    """MTP block (SWA, W keys back): at position p, tokens before p - W do not matter, p - W does."""
    cfg = TinyConfig(num_layers=1, vocab_size=64, sliding_window=5)
    model = TinyMiMo(cfg).eval()
    n, p, w = 20, 15, cfg.sliding_window
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (n,), generator=gen)
    hidden = torch.randn(n, cfg.hidden_size, generator=gen)
    attend = DenseAttend(1, n)

    def out_at_p(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.mtp_hidden(0, ids, hidden, attend.positions, attend)[p]

    base = out_at_p(ids)
    outside, edge = ids.clone(), ids.clone()
    outside[p - w - 1] = (ids[p - w - 1] + 1) % 64
    edge[p - w] = (ids[p - w] + 1) % 64
    assert torch.equal(out_at_p(outside), base)
    assert not torch.allclose(out_at_p(edge), base)


def test_dense_attend_trains_the_sinks() -> None:
    """The differentiable path used for distillation reaches every MTP parameter, sinks included."""
    cfg = TinyConfig(num_layers=1, vocab_size=64, num_mtp_layers=1)
    model = TinyMiMo(cfg)
    attend = DenseAttend(2, 12)
    ids = torch.randint(0, 64, (24,))
    logits = model.logits(model.mtp_hidden(0, ids, torch.randn(24, cfg.hidden_size), attend.positions, attend))
    torch.nn.functional.cross_entropy(logits, torch.randint(0, 64, (24,))).backward()
    sinks = model.mtp[0].layer.attn.sinks
    assert sinks is not None and sinks.grad is not None and bool(sinks.grad.abs().sum() > 0)
    assert all(p.grad is not None for p in model.mtp_parameters())
