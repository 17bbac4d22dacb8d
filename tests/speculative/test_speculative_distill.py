"""MTP distillation: training targets, greedy data, the weight cache, and that training helps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hal
from hal.errors import SpecError
from hal.spec import LayerSpec
from hal.speculative.distill import (
    DenseAttend,
    DistillConfig,
    _mtp_inputs,
    cache_path_for,
    distill,
    greedy_sequences,
    mtp_accuracy,
)
from hal.speculative.model import TinyConfig, TinyMiMo

TINY = TinyConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=6, sliding_window=8)
CPU = hal.get_backend("cpu")
QUICK = DistillConfig(num_sequences=32, seq_len=32, steps=40, batch_size=16)


def test_mtp_inputs_hand_computed() -> None:
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    ids, labels = _mtp_inputs(tokens, torch.tensor([2]), 0)
    assert ids.tolist() == [[11, 12, 13, 14, 15, 0]]  # block 0 at p reads token p + 1
    assert labels.tolist() == [[12, 13, 14, 15, -100, -100]]  # and predicts token p + 2
    ids, labels = _mtp_inputs(tokens, torch.tensor([4]), 1)
    assert ids.tolist() == [[12, 13, 14, 15, 0, 0]]  # block 1 at p reads token p + 2
    assert labels.tolist() == [[-100, 14, 15, -100, -100, -100]]  # labels inside the prompt are masked


def test_training_data_is_the_targets_greedy_continuation() -> None:
    model = TinyMiMo(TINY).eval()
    tokens, prompt_lens = greedy_sequences(model, CPU, QUICK, num=6)
    assert tokens.shape == (6, QUICK.seq_len)
    attend = DenseAttend(6, QUICK.seq_len)
    with torch.no_grad():
        argmax = model.logits(model.target_hidden(tokens.reshape(-1), attend.positions, attend)).argmax(-1)
    argmax = argmax.view(6, -1)
    for row, n in zip(range(6), prompt_lens.tolist()):
        assert QUICK.min_prompt_len <= n <= QUICK.max_prompt_len
        # every generated token is the target's argmax after the tokens before it
        assert tokens[row, n:].tolist() == argmax[row, n - 1 : -1].tolist()


def test_distillation_raises_mtp_accuracy_and_is_cached(tmp_path: Path) -> None:
    model = TinyMiMo(TINY)
    heldout, heldout_lens = greedy_sequences(model, CPU, QUICK, seed_offset=7, num=16)
    before = mtp_accuracy(model, heldout, heldout_lens)
    report = distill(model, CPU, QUICK, cache_dir=tmp_path)
    after = mtp_accuracy(model, heldout, heldout_lens)
    assert not report.from_cache and report.cache_path is not None and report.cache_path.exists()
    assert all(b < 0.1 for b in before)  # a random head is almost never right
    assert all(a > 0.5 for a in after), after
    # A fresh model with the same config and seed loads exactly these weights.
    again = TinyMiMo(TINY)
    second = distill(again, CPU, QUICK, cache_dir=tmp_path)
    assert second.from_cache and second.cache_path == report.cache_path
    for p, q in zip(model.mtp_parameters(), again.mtp_parameters()):
        assert torch.equal(p, q)
    # The target never moved, and everything is trainable again afterwards.
    fresh = TinyMiMo(TINY)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        if not name.startswith("mtp."):
            assert torch.equal(p, q), name
        assert p.requires_grad


def test_cache_key_follows_config_seed_and_weights(tmp_path: Path) -> None:
    model = TinyMiMo(TINY)
    base = cache_path_for(model, QUICK, tmp_path)
    assert cache_path_for(TinyMiMo(TINY), QUICK, tmp_path) == base
    assert cache_path_for(model, DistillConfig(num_sequences=32, seq_len=32, steps=41, batch_size=16), tmp_path) != base
    assert cache_path_for(TinyMiMo(TinyConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=6, sliding_window=8, seed=1)), QUICK, tmp_path) != base
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0  # same config, different target weights
    assert cache_path_for(model, QUICK, tmp_path) != base


def test_bad_distill_config_raises() -> None:
    with pytest.raises(SpecError, match="seq_len"):
        DistillConfig(max_prompt_len=30, seq_len=32)
    with pytest.raises(SpecError, match="batch_size"):
        DistillConfig(batch_size=0)


@pytest.mark.parametrize("window, with_sinks", [(None, False), (3, True), (None, True), (5, False)])
def test_dense_attend_is_the_oracle_batched(window: int | None, with_sinks: bool) -> None:
    """DenseAttend (training's and the demo judge's attention) equals hal.oracle.dense_attention run
    request by request, in float64, gradients included."""
    from hal.oracle import dense_attention

    gen = torch.Generator().manual_seed(3)
    n, t, hq, hkv = 3, 9, 4, 2
    layer = LayerSpec(layer_id=0, num_q_heads=hq, num_kv_heads=hkv, head_dim=6, v_head_dim=5, scaling=0.4,
                      sliding_window=window)
    q = torch.randn(n * t, hq, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(n * t, hkv, 6, generator=gen, dtype=torch.float64)
    v = torch.randn(n * t, hkv, 5, generator=gen, dtype=torch.float64)
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64) if with_sinks else None
    got = DenseAttend(n, t)(layer, q, k, v, sinks)
    want = dense_attention(q, k.split(t), v.split(t), [t] * n, scaling=0.4, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (grad_got,) = torch.autograd.grad(got.sum(), q)
    (grad_want,) = torch.autograd.grad(want.sum(), q)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-12, atol=1e-12)


def test_the_weight_fingerprint_reads_every_byte_of_the_float32_values() -> None:
    """The cache key hashes each weight's float32 bytes (copied in one call): a strided bf16 tensor
    gives the bytes of its float32, contiguous copy, element by element."""
    from hal.speculative.distill import _raw_bytes

    weight = torch.randn(6, 5, dtype=torch.bfloat16).t()
    expected = bytes(weight.to(torch.float32).contiguous().untyped_storage())  # element by element, slow
    assert _raw_bytes(weight) == expected and len(expected) == 30 * 4
