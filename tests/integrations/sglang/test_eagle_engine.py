"""EAGLE through hal inside ``sglang.Engine``: SGLang's single-layer EAGLE worker with an EAGLE
draft model, ``speculative_eagle_topk`` 1 (chains), 2 and 4 (trees), every attention call (target
prefill and tree verify, the draft's extend and its multi-step draft decode over ``topk`` branches)
through hal's backend, equal to plain decoding and to transformers token for token.

The target is a random Llama whose tokens depend on attention (checked against transformers with
its attention output removed); the draft is distilled from it, so some drafts
are accepted, some through a branch that is not the first (``hal.tools.testing.save_distilled_eagle_draft``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import sglang  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from hal.tools.testing import save_distilled_eagle_draft  # noqa: E402

NEW_TOKENS = 24
STEPS = 3
PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(10 + 3 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hal.tools.testing import save_random_llama

    # A smaller spread than the other engine tests' Llama: its tokens follow the last token often
    # enough for a one-layer draft to guess some of them; attention still decides most of them.
    return save_random_llama(tmp_path_factory.mktemp("eagle-target"), initializer_range=0.02)


@pytest.fixture(scope="module")
def draft(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_distilled_eagle_draft(target, tmp_path_factory.mktemp("eagle-draft"))


def transformers_greedy(model: Path, *, without_attention: bool = False) -> list[list[int]]:
    oracle = transformers.AutoModelForCausalLM.from_pretrained(model, use_kernels=False).eval()
    oracle.generation_config.eos_token_id = None
    if without_attention:
        for layer in oracle.model.layers:
            torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
    with torch.no_grad():
        return [oracle.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist() for p in PROMPTS]


def generate(model: Path, **engine_args: Any) -> list[dict]:
    engine = sglang.Engine(
        model_path=str(model), device="cpu", attention_backend="hal", skip_tokenizer_init=True, disable_cuda_graph=True,
        random_seed=0, max_total_tokens=4096, **engine_args,
    )
    try:
        return engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def plain_tokens(target: Path) -> list[list[int]]:
    tokens = [o["output_ids"] for o in generate(target)]
    assert tokens == transformers_greedy(target)
    changed = sum(a != b for t, u in zip(tokens, transformers_greedy(target, without_attention=True)) for a, b in zip(t, u))
    assert changed >= len(PROMPTS) * NEW_TOKENS // 2, f"attention changes only {changed} tokens"
    return tokens


@pytest.mark.parametrize("topk", [1, 2, 4])
def test_eagle_through_hal_equals_plain_decoding(
    topk: int, target: Path, draft: Path, plain_tokens: list[list[int]], sgl_kernel_calls: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SGLANG_PLATFORM", "hal")
    forwards = tmp_path / "hal_forwards.txt"
    monkeypatch.setenv("HAL_SGLANG_FORWARD_LOG", str(forwards))
    draft_tokens = 1 + STEPS * topk if topk > 1 else STEPS + 1
    out = generate(target, speculative_algorithm="EAGLE", speculative_draft_model_path=str(draft),
                   speculative_num_steps=STEPS, speculative_eagle_topk=topk, speculative_num_draft_tokens=min(draft_tokens, 8))
    assert [o["output_ids"] for o in out] == plain_tokens
    verifies = [o["meta_info"]["spec_verify_ct"] for o in out]
    assert sum(verifies) < len(PROMPTS) * NEW_TOKENS, f"no draft was accepted: {verifies}"
    served = forwards.read_text().splitlines()
    assert f"DRAFT_DECODE_STEPS topk={topk} steps={STEPS}" in served, sorted(set(served))
    verify_lines = {line for line in served if line.startswith("TARGET_VERIFY")}
    assert verify_lines and all(line.endswith(" tree") == (topk > 1) for line in verify_lines), verify_lines
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"
