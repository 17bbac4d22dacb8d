"""``sglang.Engine`` on SGLang's CPU path with the attention backend ``hal``: the same greedy tokens
as SGLang's own ``torch_native`` backend on a tiny random Llama, and nothing of hal's in the way of
a server that does not ask for it.

The Llama's weights are drawn with a large spread (``initializer_range=0.3``) so attention decides
the tokens: with SGLang's near-zero dummy weights a decode step that misses its newest key still
gave the same tokens, while with these it changes them from the second token on."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang")

import sglang  # noqa: E402

PROMPTS = [[1, 2, 3], [5, 9, 11, 13, 17, 19, 23], [7] * 12, [100, 3, 44, 250, 8]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random fp32 Llama saved by transformers."""
    from hal.tools.testing import save_random_llama

    return save_random_llama(tmp_path_factory.mktemp("tiny-llama"))


def generate(model: Path, attention_backend: str, **kwargs: object) -> list[list[int]]:
    engine = sglang.Engine(
        model_path=str(model), device="cpu", attention_backend=attention_backend, skip_tokenizer_init=True, disable_cuda_graph=True, random_seed=0, max_total_tokens=4096, **kwargs,
    )
    try:
        out = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0})
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in out]


def test_hal_gives_torch_natives_tokens(tiny_llama: Path, sgl_kernel_calls: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forwards = tmp_path / "hal_forwards.txt"
    monkeypatch.setenv("HAL_SGLANG_FORWARD_LOG", str(forwards))
    native = generate(tiny_llama, "torch_native")
    assert not forwards.exists(), "hal's backend ran for a server that asked for torch_native"
    with_hal = generate(tiny_llama, "hal")
    assert with_hal == native
    assert all(len(tokens) == NEW_TOKENS for tokens in with_hal)
    served = {tuple(line.split()) for line in forwards.read_text().splitlines()}
    # Without the platform the in-tree pool keeps its KV in hal's pool (see kv_pool.store_in_hal_pool).
    assert {("EXTEND", "MHATokenToKVPool"), ("DECODE", "MHATokenToKVPool")} <= served, served
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"


def test_hal_pages_match_torch_native(tiny_llama: Path, sgl_kernel_calls: Path) -> None:
    """With pages of 4 tokens hal's page tables come from SGLang's paged allocator."""
    assert generate(tiny_llama, "hal", page_size=4) == generate(tiny_llama, "torch_native", page_size=4)
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"


def test_platform_hal_serves_with_hals_pool(tiny_llama: Path, sgl_kernel_calls: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLANG_PLATFORM=hal: SGLang builds hal's KV pool class through the platform hook."""
    native = generate(tiny_llama, "torch_native")
    forwards = tmp_path / "hal_forwards.txt"
    monkeypatch.setenv("HAL_SGLANG_FORWARD_LOG", str(forwards))
    monkeypatch.setenv("SGLANG_PLATFORM", "hal")
    assert generate(tiny_llama, "hal") == native
    served = {tuple(line.split()) for line in forwards.read_text().splitlines()}
    assert {("EXTEND", "HalMHATokenToKVPool"), ("DECODE", "HalMHATokenToKVPool")} <= served, served
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"


def test_a_speculative_configuration_hal_refuses_is_an_exception_from_engine(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked where SGLang resolves its server arguments, in the calling process: the caller gets
    the refusal from ``sglang.Engine(...)`` (before, the scheduler refused and SGLang's handler then
    killed the caller). The configurations hal serves start as before (every EAGLE engine test)."""
    from hal.errors import UnsupportedConfigError

    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    with pytest.raises(UnsupportedConfigError, match="set SGLANG_PLATFORM=hal in the environment that starts SGLang"):
        sglang.Engine(model_path=str(tiny_llama), device="cpu", attention_backend="hal", skip_tokenizer_init=True,
                      disable_cuda_graph=True, max_total_tokens=1024, speculative_algorithm="EAGLE", speculative_num_steps=2,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=3, speculative_draft_model_path=str(tiny_llama))
