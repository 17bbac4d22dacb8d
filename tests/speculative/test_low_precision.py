"""Greedy and MTP decoding in the dtypes users run (bf16, fp16 weights and KV) on every backend,
held to the guarantee the README states for low precision.

A bf16 verify forward over S + 1 positions and S + 1 one-token decode forwards need not round
alike, so in bf16 MTP may pick another token than greedy where two logits nearly tie, and either
may depart from float32 decoding there. The guarantee: **wherever a low-precision run departs from
another (hal's MTP from hal's greedy, hal's greedy from float32 greedy), the two tokens are within
``2 * delta`` of each other in the float32 logits at that point and within ``2 * delta`` of the
float32 best**, where ``delta`` is the largest logit error transformers' own implementation makes
in that dtype on the same sequences (teacher-forced). A stale KV value, a wrong mask or a silent
cast would move tokens by far more than rounding does, and fail it.

The oracle is transformers' ``MiMoV2FlashForCausalLM`` in float32 and in the run's dtype, on a
tiny checkpoint with weights large enough that logits spread (about 2 at the top) and MTP layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import hal
from hal.speculative import GreedyDecoder, MultiLayerEagleWorker
from hal.speculative.mimo import MiMoV2Flash

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

from low_precision_guarantee import Guarantee, greedy_generate, float_logits  # noqa: E402  (after the importorskips)
from tiny_mimo_checkpoints import add_mtp_layers, hf_load, make_checkpoint  # noqa: E402

GEN = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(1, 96, (n,), generator=GEN).tolist() for n in (5, 12, 20, 33)]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("low-precision")
    make_checkpoint(directory, num_hidden_layers=6, sliding_window=5, head_dim=128, v_head_dim=128, hidden_size=64,
                    initializer_range=0.1)
    add_mtp_layers(directory, 3)
    return directory


@pytest.fixture(scope="module")
def float32_oracle(checkpoint: Path) -> Any:
    return hf_load(checkpoint)


def _agreement(runs: dict[str, tuple[tuple[int, ...], ...]], reference: Sequence[Sequence[int]]) -> dict[str, float]:
    """Per run, the share of tokens before its first departure from ``reference``."""
    rates = {}
    for name, tokens in runs.items():
        kept = sum(next((j for j, (x, y) in enumerate(zip(t, r)) if x != y), len(r)) for t, r in zip(tokens, reference))
        rates[name] = kept / sum(len(r) for r in reference)
    return rates


BACKENDS = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cpu", torch.float16, id="cpu-fp16"),
    pytest.param("npu", torch.bfloat16, id="npu-bf16"),
    pytest.param("npu", torch.float16, id="npu-fp16"),
]


def _decode_all(backend: hal.Backend, model: MiMoV2Flash, prompts: Sequence[list[int]], n: int, steps: Sequence[int],
                **engine: Any) -> dict[str, tuple[tuple[int, ...], ...]]:
    runs = {"greedy": GreedyDecoder(model, backend, **engine).generate(prompts, n).tokens}
    for s in steps:
        worker = MultiLayerEagleWorker(model, backend, num_steps=s, **engine)
        assert worker.target_pool.spec.dtype == model.spec.dtype  # KV in the weights' dtype where the kernel takes it
        runs[f"mtp S={s}"] = worker.generate(prompts, n).tokens
    return runs


def _hold_to_guarantee(guarantee: Guarantee, runs: dict[str, tuple[tuple[int, ...], ...]], label: str) -> dict[str, float]:
    for i in range(len(guarantee.prompts)):
        greedy = runs["greedy"][i]
        guarantee.check_departure(i, greedy, guarantee.reference[i], f"{label} greedy vs float32")
        for name, tokens in runs.items():
            if name != "greedy":
                guarantee.check_departure(i, tokens[i], greedy, f"{label} {name} vs greedy")
    return _agreement(runs, guarantee.reference)


@pytest.mark.parametrize(("device", "dtype"), BACKENDS)
def test_greedy_and_mtp_in_low_precision_keep_the_guarantee(
    checkpoint: Path, float32_oracle: Any, device: str, dtype: torch.dtype, record_property: Any
) -> None:
    backend = hal.get_backend(device, emulate=device != "cpu")
    model = MiMoV2Flash.from_pretrained(checkpoint, dtype=dtype)
    assert model.spec.dtype == dtype
    guarantee = Guarantee(checkpoint, float32_oracle, dtype, PROMPTS, NEW_TOKENS)
    runs = _decode_all(backend, model, PROMPTS, NEW_TOKENS, (1, 2, 3), max_batch_size=4, max_seq_len=96,
                       graph_batch_sizes=[4])
    runs["transformers"] = tuple(tuple(greedy_generate(guarantee.low, p, NEW_TOKENS)) for p in PROMPTS)
    rates = _hold_to_guarantee(guarantee, runs, f"{device} {dtype}")
    record_property("agreement_with_float32", rates)
    print(f"{device} {dtype}: share of tokens before the first departure from float32 greedy: {rates}")


def test_greedy_and_mtp_in_bf16_on_the_triton_interpreter(checkpoint: Path, float32_oracle: Any) -> None:
    """The cuda backend's Triton kernels (interpreted, so small: two prompts, 12 tokens)."""
    backend = hal.get_backend("cuda", emulate=True)
    model = MiMoV2Flash.from_pretrained(checkpoint, dtype=torch.bfloat16)
    prompts, n = PROMPTS[:2], 12
    guarantee = Guarantee(checkpoint, float32_oracle, torch.bfloat16, prompts, n)
    runs = _decode_all(backend, model, prompts, n, (1, 3), max_batch_size=2, max_seq_len=64, graph_batch_sizes=[2])
    rates = _hold_to_guarantee(guarantee, runs, "cuda bf16")
    print(f"cuda bf16: share of tokens before the first departure from float32 greedy: {rates}")


def test_the_guarantee_catches_a_token_that_rounding_cannot_explain(checkpoint: Path, float32_oracle: Any) -> None:
    """The check itself: a continuation that departs where float32 has a clear winner fails it."""
    guarantee = Guarantee(checkpoint, float32_oracle, torch.bfloat16, PROMPTS[:1], 8)
    reference = guarantee.reference[0]
    logits = float_logits(float32_oracle, PROMPTS[0])[-1]
    wrong = int(logits.argmin())  # the float32 worst token, far from any tie
    with pytest.raises(AssertionError, match="beyond 2 \\* delta"):
        guarantee.check_departure(0, [wrong, *reference[1:]], reference, "planted")
