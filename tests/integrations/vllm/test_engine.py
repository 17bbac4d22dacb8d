"""hal inside ``vllm.LLM`` on the CPU, token for token against vLLM's own CPU attention backend.

Batches as vLLM builds them: prompts that straddle its 32-token blocks, chunked prefill (a 48-token
budget splits the long prompts, and decode rows of the short ones ride in the same forwards), and a
second round whose prompts extend the first's (prefix-cache hits). Each model's tokens are checked
to depend on attention (a prompt that differs only before its last two tokens continues differently).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm")

from conftest import BF16_TIE, assert_same_greedy_tokens, run_engine  # noqa: E402


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(3)
    long = [rng.randrange(256) for _ in range(70)]
    other = [rng.randrange(256) for _ in range(45)]
    # Eight earlier tokens changed (inside every window), the last two kept: the continuation
    # differs only through attention.
    earlier_tokens_changed = [*long[:-10], *((t + 1) % 256 for t in long[-10:-2]), *long[-2:]]
    rounds = [long, other, [5, 6, 7], earlier_tokens_changed]
    again = [long + [rng.randrange(256) for _ in range(10)], other[:40] + [1, 2]]
    return rounds, again


def _request(model: Any, **extra: Any) -> dict[str, Any]:
    first, second = _prompts()
    return {"model": str(model), "rounds": [first, second], "max_tokens": 12, "max_num_batched_tokens": 48, **extra}


@pytest.mark.parametrize(("model", "dtype"), [("llama", "float32"), ("qwen3", "float32"), ("mistral", "float32"), ("llama", "bfloat16")])
def test_hal_equals_vllms_cpu_backend(checkpoints: dict[str, Any], model: str, dtype: str) -> None:
    """float32: token for token. bfloat16: token for token up to the first rounding tie of a request
    (its two likeliest tokens one or two bfloat16 steps apart in both engines)."""
    request = _request(checkpoints[model], dtype=dtype, logprobs=2)
    ours, theirs = run_engine(request, hal=True), run_engine(request, hal=False)
    assert ours["hal_forwards"] > 0 and theirs["hal_forwards"] == 0  # each engine ran the backend it names
    if dtype == "float32":
        assert ours["tokens"] == theirs["tokens"]
    else:
        assert_same_greedy_tokens(ours, theirs, tie=BF16_TIE)
    first_round = ours["tokens"][0]
    assert first_round[0] != first_round[3], "the tokens do not depend on attention (earlier prompt tokens changed, same text)"
    assert ours["prefix_cache_hits"] and ours["prefix_cache_hits"] >= 64  # the second round reused the first's blocks


@pytest.mark.parametrize("model", ["llama-hd128", "qwen3-hd128"])
def test_hals_emulated_ascend_backend_in_vllm_equals_vllms_cpu_backend(checkpoints: dict[str, Any], model: str) -> None:
    """hal's Ascend backend under vLLM (``HAL_VLLM_DEVICE=npu HAL_VLLM_EMULATE=1``): vLLM runs on the
    CPU while every attention layer is one FIA v2 call over hal's pool on vLLM's own allocation, pages
    of 128 tokens (a 200-token prompt spans two, prefilled in chunks of 48, and its first page is a
    prefix-cache hit for the next round), bfloat16; against vLLM's CPU backend under the bfloat16
    tie rule."""
    rng = random.Random(5)
    long = [rng.randrange(256) for _ in range(200)]  # two pages; its first page is reused by round 2
    first, _ = _prompts()
    request = _request(checkpoints[model], dtype="bfloat16", logprobs=2, block_size=128)
    request["rounds"] = [[long, *first], [long + [rng.randrange(256) for _ in range(12)]]]
    ours, theirs = run_engine(request, hal=True, hal_device="npu"), run_engine(request, hal=False)
    assert ours["hal_forwards"] > 0 and ours["npu_calls"]["FIA"] == ours["hal_forwards"], ours["npu_calls"]
    assert ours["npu_calls"]["SCATTER"] == 2 * ours["npu_calls"]["FIA"]  # K and V written per layer call
    assert theirs["npu_calls"]["FIA"] == 0
    assert_same_greedy_tokens(ours, theirs, tie=BF16_TIE)
    first_round = ours["tokens"][0]
    assert first_round[1] != first_round[4], "the tokens do not depend on attention"  # _prompts' 0 and 3
    assert ours["prefix_cache_hits"] and ours["prefix_cache_hits"] >= 128  # round 2 reused round 1's first page


def test_the_window_test_sees_one_key(checkpoints: dict[str, Any]) -> None:
    """hal maps vLLM's window (W keys, the query's own included) to its own (W - 1 keys before
    it): on these prompts, a window one key wider gives other tokens, so an off-by-one in that
    mapping would fail ``test_hal_equals_vllms_cpu_backend[mistral]``."""
    narrow = run_engine(_request(checkpoints["mistral"]), hal=False)
    wide = run_engine(_request(checkpoints["mistral-window-25"]), hal=False)
    assert narrow["tokens"] != wide["tokens"]


def test_ngram_speculation_through_hal_equals_plain_decoding(checkpoints: dict[str, Any]) -> None:
    """vLLM's n-gram speculative decoding (the method its CPU build runs without a draft model):
    its verify rows go through hal's kernel, and what it accepts equals plain greedy decoding."""
    prompts = [[5, 6, 7], [1, 6, 7], [9, 9, 4, 2]]
    plain = {"model": str(checkpoints["llama-repetitive"]), "rounds": [prompts], "max_tokens": 48}
    speculative = {**plain, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                                    "prompt_lookup_min": 1}}
    ours = run_engine(speculative, hal=True)
    assert ours["tokens"] == run_engine(plain, hal=True)["tokens"] == run_engine(plain, hal=False)["tokens"]
    assert ours["hal_forwards"] > 0
    assert ours["spec_accepted"] and ours["spec_accepted"] > 0, ours


def test_eagle_speculation_through_hal_equals_plain_decoding(checkpoints: dict[str, Any]) -> None:
    """vLLM's EAGLE proposer on the CPU: the draft model's layer and the target's verify rows both go
    through hal's kernel, and what vLLM accepts equals plain greedy decoding with vLLM's own backend."""
    prompts = [[5, 6, 7], [1, 6, 7, 100, 3], [9, 9, 4, 2]]
    plain = {"model": str(checkpoints["llama-eagle-target"]), "rounds": [prompts], "max_tokens": 32}
    speculative = {**plain, "speculative_config": {"method": "eagle", "model": str(checkpoints["eagle-draft"]),
                                                    "num_speculative_tokens": 3}}
    ours = run_engine(speculative, hal=True)
    assert ours["tokens"] == run_engine(plain, hal=False)["tokens"]
    target_layers = {f"model.layers.{i}.self_attn.attn" for i in range(2)}
    assert set(ours["hal_layers"]) == target_layers | {"model.layers.2.self_attn.attn"}, ours["hal_layers"]  # the draft's layer is numbered after the target's
    assert ours["spec_accepted"] and ours["spec_accepted"] > 0, ours


def test_the_tie_rule_refuses_a_clear_difference() -> None:
    """The bfloat16 comparison forgives a tie in both engines and nothing else."""
    tokens = {"tokens": [[[1, 2]]], "likeliest": [[[[[1, -0.1], [5, -3.0]], [[2, -1.0], [3, -1.0625]]]]]}
    tied_other_way = {"tokens": [[[1, 3]]], "likeliest": [[[[[1, -0.1], [5, -3.0]], [[3, -1.0], [2, -1.0]]]]]}
    assert_same_greedy_tokens(tokens, tied_other_way, tie=BF16_TIE)
    clear_other_way = {"tokens": [[[1, 3]]], "likeliest": [[[[[1, -0.1], [5, -3.0]], [[3, -1.0], [2, -1.5]]]]]}
    with pytest.raises(AssertionError, match="not a tie"):
        assert_same_greedy_tokens(tokens, clear_other_way, tie=BF16_TIE)


def test_asking_for_hal_without_its_platform_is_refused_by_name(checkpoints: dict[str, Any]) -> None:
    """``attention_backend="HAL"`` without ``HAL_VLLM_PLATFORM=1``: vLLM's CPU platform would serve
    the model with its own backend instead, silently; the engine refuses to start, naming the
    variable. With the platform, the same request runs through hal."""
    request = {"model": str(checkpoints["llama"]), "rounds": [[[1, 2, 3]]], "max_tokens": 2, "attention_backend": "HAL"}
    with pytest.raises(AssertionError, match="set HAL_VLLM_PLATFORM=1"):
        run_engine(request, hal=False)
    assert run_engine(request, hal=True)["hal_forwards"] > 0
