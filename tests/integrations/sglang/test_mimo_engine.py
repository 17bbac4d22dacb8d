"""MiMo-V2-Flash in ``sglang.Engine(device="cpu", attention_backend="hal")``: greedy tokens equal
transformers' ``generate`` and ``hal generate`` on the same tiny checkpoint.

The checkpoint is saved by transformers' ``MiMoV2FlashForCausalLM`` (hybrid full/sliding-window
layers, sinks on the sliding-window ones, qk 24 / v 8, 1 kv head on full layers and 2 on
sliding-window ones, MoE layers with grouped sigmoid routing), then hal writes its config in the
published form SGLang's ``models/mimo_v2.py`` reads (``MiMoConfig.published_dict``), loaded with
the rope override SGLang 0.5.23 needs on a CPU (``mimo_rope_override``). Weights are drawn with a large spread so
attention decides the tokens. SGLang's own ``torch_native`` cannot run this model (it takes no
sinks): hal is its CPU path. The prompts are longer than the window (4 keys back), batched, share
prefixes (radix reuse) and one is longer than the prefill chunk.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import sglang  # noqa: E402
import torch  # noqa: E402

from hal.integrations.sglang import mimo_rope_override  # noqa: E402
from hal.tools.testing import save_published_copy, spread_sinks_and_router  # noqa: E402

transformers = pytest.importorskip("transformers")

CONFIG: dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
    v_head_dim=8, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    max_position_embeddings=512, num_hidden_layers=6, sliding_window=5, initializer_range=0.3,
    # SGLang's MiMo runs its experts with routed_scaling_factor 1.0, the published model's value (null).
    routed_scaling_factor=1.0,
)
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    SHARED + [30, 31, 32],
    SHARED + [40, 41, 42, 43, 44, 45],
    [(7 * i) % 90 + 3 for i in range(40)],  # longer than the prefill chunk
]
NEW_TOKENS = 10
CHUNK = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """The published-form checkpoint directory and transformers' greedy tokens for ``PROMPTS``."""
    hf_dir = tmp_path_factory.mktemp("mimo-transformers")
    torch.manual_seed(0)
    model = transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(**CONFIG)).eval()
    spread_sinks_and_router(model)
    model.save_pretrained(hf_dir)
    oracle = transformers.MiMoV2FlashForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", use_kernels=False).eval()
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = oracle.generate(torch.tensor([prompt]), max_new_tokens=2 * NEW_TOKENS, do_sample=False, min_new_tokens=2 * NEW_TOKENS)
            expected.append(out[0, len(prompt) :].tolist())
    published = save_published_copy(hf_dir, tmp_path_factory.mktemp("mimo-published"))
    assert len({tuple(t) for t in expected}) == len(PROMPTS)
    return published, expected  # 2 * NEW_TOKENS per prompt


def sglang_tokens(model: Path, **kwargs: Any) -> list[list[int]]:
    engine = sglang.Engine(
        model_path=str(model), device="cpu", attention_backend="hal", skip_tokenizer_init=True, disable_cuda_graph=True,
        random_seed=0, max_total_tokens=2048, chunked_prefill_size=CHUNK, json_model_override_args=mimo_rope_override(model), dtype="float32",
        **kwargs,
    )
    """Greedy tokens for ``PROMPTS``, then ``NEW_TOKENS`` more for two of them, continued from the
    radix cache (a prefix is reusable while its last window's SWA KV is kept: the end of a finished
    request, not the end of its prompt)."""
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        first = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=params)]
        continued = [PROMPTS[i] + first[i] for i in (1, 2)]
        again = engine.generate(input_ids=continued, sampling_params=params)
    finally:
        engine.shutdown()
    cached = [o["meta_info"]["cached_tokens"] for o in again]
    assert all(c >= len(SHARED) for c in cached), cached  # how deep SGLang keeps SWA KV is its choice
    return first + [o["output_ids"] for o in again]


def expected_tokens(oracle: list[list[int]]) -> list[list[int]]:
    """What ``sglang_tokens`` returns when it equals transformers."""
    return [t[:NEW_TOKENS] for t in oracle] + [oracle[i][NEW_TOKENS:] for i in (1, 2)]


def test_hal_generate_equals_transformers(checkpoint: tuple[Path, list[list[int]]], tmp_path: Path) -> None:
    model, expected = checkpoint
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    run = subprocess.run(
        [sys.executable, "-m", "hal.tools.cli", "generate", "--model", str(model), "--prompts-file", str(prompts),
         "--max-new-tokens", str(NEW_TOKENS), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(run.stdout)["tokens"] == [t[:NEW_TOKENS] for t in expected]


@pytest.mark.parametrize("page_size", [1, 16])
def test_sglang_with_hal_equals_transformers(checkpoint: tuple[Path, list[list[int]]], page_size: int, sgl_kernel_calls: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, expected = checkpoint
    forwards = tmp_path / "hal_forwards.txt"
    monkeypatch.setenv("HAL_SGLANG_FORWARD_LOG", str(forwards))
    assert sglang_tokens(model, page_size=page_size) == expected_tokens(expected)
    served = {tuple(line.split()) for line in forwards.read_text().splitlines()}
    assert {("EXTEND", "SWAKVPool"), ("DECODE", "SWAKVPool")} <= served, served
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"


def test_platform_hal_serves_mimo(checkpoint: tuple[Path, list[list[int]]], sgl_kernel_calls: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLANG_PLATFORM=hal: the SWAKVPool's sub-pools are hal's pool class, stored in one hybrid hal pool."""
    model, expected = checkpoint
    forwards = tmp_path / "hal_forwards.txt"
    monkeypatch.setenv("HAL_SGLANG_FORWARD_LOG", str(forwards))
    monkeypatch.setenv("SGLANG_PLATFORM", "hal")
    assert sglang_tokens(model, page_size=16) == expected_tokens(expected)
    served = {tuple(line.split()) for line in forwards.read_text().splitlines()}
    assert {("EXTEND", "SWAKVPool"), ("DECODE", "SWAKVPool")} <= served, served
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"
