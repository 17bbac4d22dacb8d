"""The plain decoder ``hal bench`` compares against (contiguous KV cache + SDPA, no hal attention)
produces hal greedy's tokens on a model with sliding windows, sinks and GQA, past the window."""

from __future__ import annotations

import pytest

import hal

from hal.errors import SpecError
from hal.speculative import GreedyDecoder
from hal.speculative.model import TinyConfig, TinyMiMo
from hal.tools.plain_decoder import PlainDecoder


@pytest.mark.parametrize("batch, prompt_len", [(1, 3), (3, 21)])
def test_plain_decoder_tokens_equal_hal_greedy(batch: int, prompt_len: int) -> None:
    model = TinyMiMo(TinyConfig(num_layers=6, sliding_window=5, num_mtp_layers=1, seed=3))
    prompts = [[(7 * b + 3 * i) % 500 + 1 for i in range(prompt_len)] for b in range(batch)]
    expect = GreedyDecoder(model, hal.get_backend("cpu"), max_batch_size=batch, max_seq_len=prompt_len + 20).generate(prompts, 12)
    got = PlainDecoder(model).generate(prompts, 12)
    assert got.tokens == expect.tokens
    assert len(set(got.tokens[0])) > 1  # a continuation, not one repeated token


def test_plain_decoder_refuses_ragged_prompts() -> None:
    with pytest.raises(SpecError, match="equal length"):
        PlainDecoder(TinyMiMo(TinyConfig(num_layers=2, num_mtp_layers=1))).generate([[1, 2], [3]], 2)
