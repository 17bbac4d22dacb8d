"""The seed's model in vLLM: MiMo-V2-Flash and its MTP through hal, which vLLM's CPU build cannot run
by itself (its qk != v layers take Triton-only backends).

The checkpoint is hal's tiny MiMo-V2-Flash (18 hybrid layers: 4 full-attention layers with 1 KV
head and 14 sliding-window layers of 16 keys with 2 KV heads and sinks; qk 192 / v 128) with MTP
layers distilled to predict it, saved in the published config form vLLM reads; transformers loads
the same weights as the oracle. vLLM backs a full and a sliding-window layer with one KV tensor,
the full layers' blocks holding twice the tokens; hal's K/V planes over it agree block for block
(``attention._check_shared_caches``). vLLM's MiMo names the window as the published config does
(keys before the query), one key short of the reference: ``patches/mimo_v2_window_counts_the_query.patch``
fixes it, tested here before and after.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import vllm  # noqa: E402

import hal.integrations.vllm  # noqa: E402
from conftest import run_engine  # noqa: E402
from hal.speculative.distill import distill  # noqa: E402
from hal.speculative.model import TinyConfig, TinyMiMo  # noqa: E402
from hal.tools.demo import make_prompts  # noqa: E402
from hal.tools.testing import pinned_source, save_published_copy  # noqa: E402
from low_precision_guarantee import Guarantee, greedy_generate  # noqa: E402

NEW_TOKENS = 16
WINDOW_PATCH = "mimo_v2_window_counts_the_query.patch"
MIMO_MODULE = "vllm/model_executor/models/mimo_v2.py"


def _rounds() -> list[list[list[int]]]:
    """Round 1: the demo's four short prompts, a 70-token prompt (past the 16-key window, in two
    chunks of the 48-token budget) and the same prompt with eight earlier tokens changed (the last
    two kept: it continues differently only through attention). Round 2 extends the long prompt
    (its first four 16-token blocks are a prefix-cache hit)."""
    vocab = TinyConfig().vocab_size
    rng = random.Random(5)
    long = [rng.randrange(vocab) for _ in range(70)]
    changed = [*long[:-10], *((t + 1) % vocab for t in long[-10:-2]), *long[-2:]]
    return [[*make_prompts(4, vocab, 0), long, changed], [long + [rng.randrange(vocab) for _ in range(9)]]]


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The published checkpoint with three distilled MTP layers, its transformers form, and
    transformers' float32 greedy tokens for every round."""
    tiny = TinyMiMo(TinyConfig(seed=0, num_mtp_layers=3))
    distill(tiny, hal.get_backend("cpu"))
    hf_dir = tiny.save_pretrained(tmp_path_factory.mktemp("mimo-transformers"))
    oracle = transformers.MiMoV2FlashForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", use_kernels=False).eval()
    rounds = _rounds()
    expected = [[greedy_generate(oracle, p, NEW_TOKENS) for p in prompts] for prompts in rounds]
    published = save_published_copy(hf_dir, tmp_path_factory.mktemp("mimo-published"))
    return {"published": published, "hf_dir": hf_dir, "oracle": oracle, "rounds": rounds, "expected": expected}


def _request(mimo: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": str(mimo["published"]), "rounds": mimo["rounds"], "max_tokens": NEW_TOKENS, "block_size": 16,
            "max_num_batched_tokens": 48, **extra}


ATTENTION_LAYERS = {f"model.layers.{i}.self_attn.attn" for i in range(18)}


def test_mimo_through_hal_equals_transformers(mimo: dict[str, Any]) -> None:
    """float32: every token of every request equals transformers' greedy decoding, with the long
    prompts prefilled in chunks and the second round a prefix-cache hit; hal served every layer."""
    ours = run_engine(_request(mimo), hal=True)
    assert ours["tokens"] == mimo["expected"]
    assert set(ours["hal_layers"]) == ATTENTION_LAYERS
    assert ours["prefix_cache_hits"] and ours["prefix_cache_hits"] >= 64
    long, changed = ours["tokens"][0][4], ours["tokens"][0][5]
    assert long != changed, "the tokens do not depend on attention (earlier prompt tokens changed, same text)"


def test_mimo_through_hal_in_bfloat16_keeps_the_low_precision_guarantee(mimo: dict[str, Any]) -> None:
    """bfloat16 weights and KV: where a request departs from transformers' float32 tokens, both
    tokens are within the README's rounding bound (``low_precision_guarantee``)."""
    ours = run_engine(_request(mimo, dtype="bfloat16"), hal=True)
    for prompts, expected, got in zip(mimo["rounds"], mimo["expected"], ours["tokens"], strict=True):
        guarantee = Guarantee(mimo["hf_dir"], mimo["oracle"], torch.bfloat16, prompts, NEW_TOKENS)
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            guarantee.check_departure(i, a, b, "vLLM through hal, bfloat16")


@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_vllms_mimo_mtp_through_hal_is_lossless_and_accepts_drafts(mimo: dict[str, Any], draft_tokens: int) -> None:
    """vLLM's MiMo MTP proposer (``mimo_v2_mtp``), its draft layer on hal's kernel too: the tokens
    are transformers' (plain greedy decoding's), and the distilled MTP layer's drafts are accepted."""
    ours = run_engine(_request(mimo, speculative_config={"method": "mimo_v2_mtp", "num_speculative_tokens": draft_tokens}), hal=True)
    assert ours["tokens"] == mimo["expected"]
    assert set(ours["hal_layers"]) == ATTENTION_LAYERS | {"model.mtp.layers.0.self_attn.attn"}
    accept_length = 1 + ours["spec_accepted"] / ours["spec_drafts"]
    print(f"vLLM MiMo MTP through hal, {draft_tokens} draft tokens: accept length {accept_length:.2f} of {draft_tokens + 1}")
    assert accept_length > 1 + 0.6 * draft_tokens  # the distilled layer drafts the target's tokens


def _unpatched_mimo_module(tmp_path: Path) -> Path:
    """vLLM's pinned ``models/mimo_v2.py`` without hal's window patch."""
    assert vllm.__version__ == hal.integrations.vllm.TESTED_VLLM_VERSION
    patch = Path(hal.integrations.vllm.__file__).parent / "patches" / WINDOW_PATCH
    tree = pinned_source(tmp_path, Path(vllm.__file__).parent.parent / MIMO_MODULE, MIMO_MODULE, patch)
    assert subprocess.run(["git", "apply", "--check", str(patch)], cwd=tree, capture_output=True).returncode == 0
    return tree / MIMO_MODULE


def test_the_window_patch_before_and_after(mimo: dict[str, Any], tmp_path: Path) -> None:
    """Without the patch vLLM's MiMo gives each sliding-window layer 16 keys, not the reference's
    17 (16 before the query, and the query): the long prompts' tokens leave transformers'. With
    it (the installed vLLM) they are transformers' (``test_mimo_through_hal_equals_transformers``)."""
    unpatched = _unpatched_mimo_module(tmp_path)
    before = run_engine(_request(mimo, module_files={"vllm.model_executor.models.mimo_v2": str(unpatched)}), hal=True)
    assert before["tokens"] != mimo["expected"]


def test_mimo_and_its_mtp_on_hals_emulated_ascend_backend_keep_the_guarantee(mimo: dict[str, Any]) -> None:
    """``HAL_VLLM_DEVICE=npu HAL_VLLM_EMULATE=1``: every attention layer, the MTP draft layer's
    included, is one FIA v2 call over hal's pools on vLLM's allocation (pages of 128 tokens for the
    sliding-window layers, 256 for the full ones), bfloat16, three draft tokens; each request
    departs from transformers' float32 tokens only within the rounding bound."""
    request = _request(mimo, dtype="bfloat16", block_size=128,
                       speculative_config={"method": "mimo_v2_mtp", "num_speculative_tokens": 3})
    ours = run_engine(request, hal=True, hal_device="npu")
    assert ours["npu_calls"]["FIA"] == ours["hal_forwards"] > 0
    assert ours["npu_calls"]["SCATTER"] == 2 * ours["hal_forwards"]  # K and V, one scatter each
    assert ours["spec_drafts"] and 1 + ours["spec_accepted"] / ours["spec_drafts"] > 2.0
    for prompts, expected, got in zip(mimo["rounds"], mimo["expected"], ours["tokens"], strict=True):
        guarantee = Guarantee(mimo["hf_dir"], mimo["oracle"], torch.bfloat16, prompts, NEW_TOKENS)
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            guarantee.check_departure(i, a, b, "vLLM through hal's emulated Ascend backend, bfloat16")
