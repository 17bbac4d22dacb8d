"""NGRAM speculative decoding through hal inside ``sglang.Engine``: tree verify batches whose
accepted path runs through a second branch, equal to plain decoding token for token.

NGRAM drafts from an n-gram store of what the server has seen. Two prompts share their last 12
tokens (the store's longest match window) and, on the random Llama (attention decides its tokens),
both continue that suffix with the same first token but different second tokens: after a first
round, the store holds both continuations, so the second round's first verify is a tree that
branches at its second row, and one of the prompts is accepted through the branch that is not the
first. A verify that let a row see its sibling (a chain's mask) gives other tokens there, which
this test was checked against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import sglang  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

SUFFIX = list(range(40, 52))  # as long as NGRAM's default match window
NEW_TOKENS = 24
DRAFT_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hal.tools.testing import save_random_llama

    return save_random_llama(tmp_path_factory.mktemp("tiny-llama-ngram"))


def branching_prompts(model: Path) -> list[list[int]]:
    """Two prompts ``head + SUFFIX`` whose greedy continuations (transformers' forward) share their
    first token and differ in the second: the n-gram store branches right after that token."""
    oracle = transformers.AutoModelForCausalLM.from_pretrained(model, use_kernels=False).eval()
    first_seen: dict[int, tuple[list[int], int]] = {}
    with torch.no_grad():
        for seed in range(200):
            head = torch.randint(60, 250, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
            prompt = head + SUFFIX
            t1, t2 = oracle.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False)[0, len(prompt) :].tolist()
            if t1 in first_seen and first_seen[t1][1] != t2:
                return [first_seen[t1][0], prompt]
            first_seen.setdefault(t1, (prompt, t2))
    raise AssertionError("no two prompts continue the suffix with the same token and then differ")


def two_rounds(model: Path, prompts: list[list[int]], **engine_args: Any) -> tuple[list[dict], list[dict]]:
    engine = sglang.Engine(
        model_path=str(model), device="cpu", attention_backend="hal", skip_tokenizer_init=True, disable_cuda_graph=True,
        random_seed=0, max_total_tokens=4096, **engine_args,
    )
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        return engine.generate(input_ids=prompts, sampling_params=sampling), engine.generate(input_ids=prompts, sampling_params=sampling)
    finally:
        engine.shutdown()


def test_ngram_tree_verify_through_hal_equals_plain_decoding(
    tiny_llama: Path, sgl_kernel_calls: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = branching_prompts(tiny_llama)
    monkeypatch.setenv("SGLANG_PLATFORM", "hal")
    forwards = tmp_path / "hal_forwards.txt"
    monkeypatch.setenv("HAL_SGLANG_FORWARD_LOG", str(forwards))
    spec_first, spec_second = two_rounds(tiny_llama, prompts, speculative_algorithm="NGRAM",
                                         speculative_num_draft_tokens=DRAFT_TOKENS)
    plain, _ = two_rounds(tiny_llama, prompts)
    tokens = [o["output_ids"] for o in plain]
    assert [o["output_ids"] for o in spec_first] == [o["output_ids"] for o in spec_second] == tokens
    assert tokens[0][0] == tokens[1][0] and tokens[0][1] != tokens[1][1]  # the store branches after the first token
    # The second round drafts from the first round's continuations: whole drafts are accepted.
    verifies = [o["meta_info"]["spec_verify_ct"] for o in spec_second]
    assert all(v <= NEW_TOKENS // 4 for v in verifies), verifies
    served = {line.split()[0] for line in forwards.read_text().splitlines()}
    assert "TARGET_VERIFY" in served, served
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"
