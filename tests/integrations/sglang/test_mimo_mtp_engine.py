"""The seed's workload inside SGLang: MiMo-V2-Flash with its MTP layers as multi-layer EAGLE,
``sglang.Engine(device="cpu", attention_backend="hal", speculative_algorithm="EAGLE")`` under
``SGLANG_PLATFORM=hal`` with hal's upstream patches applied (``.ci/apply-sglang-patches``).

The checkpoint is hal's tiny MiMo-V2-Flash (18 hybrid layers, sinks on sliding-window layers, qk
192 / v 128) with three MTP layers distilled to predict it, saved in the published config form
SGLang reads; transformers loads the same weights as the oracle. SGLang runs its MiMo MTP draft
model (``models/mimo_v2_nextn.py``) one layer per draft step; every attention call of the target
verify, the draft extends and the prefills goes through hal's backend over hal's hybrid pools.
On SGLang's CPU path the multi-layer worker captures no graphs; the draft-extend runner the
platform supplies is tested on the emulated Ascend backend in ``test_graph_backend.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import sglang  # noqa: E402
import torch  # noqa: E402

import hal  # noqa: E402
from hal.integrations.sglang import mimo_rope_override  # noqa: E402
from hal.speculative.distill import distill  # noqa: E402
from hal.speculative.mimo_config import MiMoConfig  # noqa: E402
from hal.speculative.model import TinyConfig, TinyMiMo  # noqa: E402
from hal.tools.demo import make_prompts  # noqa: E402
from hal.tools.testing import save_published_copy  # noqa: E402

transformers = pytest.importorskip("transformers")

STEPS = 3
NEW_TOKENS = 24
PROMPTS = make_prompts(4, TinyConfig().vocab_size, 0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], Path]:
    """The published-form checkpoint with MTP layers, transformers' greedy tokens, and the
    transformers-form copy (the oracle's)."""
    tiny = TinyMiMo(TinyConfig(seed=0, num_mtp_layers=STEPS))
    distill(tiny, hal.get_backend("cpu"))
    hf_dir = tiny.save_pretrained(tmp_path_factory.mktemp("mimo-mtp-transformers"))
    oracle = transformers.MiMoV2FlashForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", use_kernels=False).eval()
    with torch.no_grad():
        expected = [
            oracle.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    assert MiMoConfig.from_file(hf_dir / "config.json").num_mtp_layers == STEPS
    published = save_published_copy(hf_dir, tmp_path_factory.mktemp("mimo-mtp-published"))
    return published, expected, hf_dir


def sglang_generate(model: Path, speculative: bool, **engine_args: Any) -> list[dict[str, Any]]:
    return sglang_rounds(model, [(PROMPTS, NEW_TOKENS)], speculative, **engine_args)[0]


def sglang_rounds(
    model: Path, rounds: list[tuple[list[list[int]], int]], speculative: bool = True, **engine_args: Any
) -> list[list[dict[str, Any]]]:
    """One engine through hal (multi-layer EAGLE when ``speculative``), one ``generate`` per round of
    (prompts, new tokens)."""
    spec = dict(
        speculative_algorithm="EAGLE", speculative_num_steps=STEPS, speculative_eagle_topk=1,
        speculative_num_draft_tokens=STEPS + 1, speculative_draft_model_path=str(model),
    ) if speculative else {}  # fmt: skip
    engine = sglang.Engine(
        model_path=str(model), device="cpu", attention_backend="hal", skip_tokenizer_init=True,
        random_seed=0, max_total_tokens=4096, json_model_override_args=mimo_rope_override(model),
        **{"dtype": "float32", "disable_cuda_graph": True, **spec, **engine_args},
    )
    try:
        return [engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0, "ignore_eos": True})
                for prompts, new in rounds]
    finally:
        engine.shutdown()


def test_prefill_draft_extend_runs_over_the_window_tail_and_drafts_the_same(
    checkpoint: tuple[Path, list[list[int]], Path], sgl_kernel_calls: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upstream patch ``multi_layer_eagle_worker_v2_prefill_draft_extend_window_tail.patch``:
    MiMo's MTP layers attend a window of W keys, so without a radix cache each prefill's draft
    extend runs over each request's last W + 1 positions only, and drafts what the whole-prompt
    extend (upstream's, restored by the test site's ``HAL_SGLANG_WHOLE_PREFILL_DRAFT_EXTEND``)
    drafts: the same first drafts and probabilities, each request verified as often, transformers'
    tokens. With SGLang's radix cache a later request may match any prefix of an earlier one and
    read the draft's KV there, so the extend runs over the whole prompt, hits included (the second
    round matches 25 and 40 tokens inside a prompt whose request ended at its first token, so the
    SWA radix cache still holds the window before each hit)."""
    model, _, hf_dir = checkpoint
    window = TinyConfig().sliding_window  # hal's W (keys before the query): SGLang's sliding_window_size
    gen = torch.Generator().manual_seed(7)
    vocab = TinyConfig().vocab_size
    first = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (45, 30, window + 1, 9)]
    second = [first[0][:25] + torch.randint(1, vocab, (12,), generator=gen).tolist(),
              first[0][:40] + torch.randint(1, vocab, (8,), generator=gen).tolist()]
    oracle = transformers.MiMoV2FlashForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", use_kernels=False).eval()

    def greedy(prompts: list[list[int]], new: int) -> list[list[int]]:
        with torch.no_grad():
            return [oracle.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, len(p):].tolist()
                    for p in prompts]

    monkeypatch.setenv("SGLANG_PLATFORM", "hal")
    monkeypatch.setenv("HAL_SGLANG_FORWARD_LOG", str(tmp_path / "forwards.txt"))
    runs = {}
    for label, rounds, radix_off in (("whole", [(first, NEW_TOKENS)], True), ("tail", [(first, NEW_TOKENS)], True),
                                     ("radix", [(first, 1), (second, NEW_TOKENS)], False)):
        extends, drafted = tmp_path / f"extends-{label}.txt", tmp_path / f"drafts-{label}.jsonl"
        monkeypatch.setenv("HAL_SGLANG_EXTEND_LOG", str(extends))
        monkeypatch.setenv("HAL_SGLANG_PREFILL_DRAFT_LOG", str(drafted))
        monkeypatch.setenv("HAL_SGLANG_WHOLE_PREFILL_DRAFT_EXTEND", "1" if label == "whole" else "0")
        out = sglang_rounds(model, rounds, disable_radix_cache=radix_off)
        assert [[o["output_ids"] for o in round_out] for round_out in out] == [greedy(*r) for r in rounds], label
        # Each prefill: the target's forward over the new tokens (prefix lens, extend lens), then
        # one draft extend per MTP layer.
        lines = [tuple([int(n) for n in column.split(",")] for column in line.split()) for line in extends.read_text().splitlines()]
        assert len(lines) % (STEPS + 1) == 0, lines
        runs[label] = {
            "prefills": [(lines[i], lines[i + 1 : i + STEPS + 1]) for i in range(0, len(lines), STEPS + 1)],
            "drafts": {d["prompt"]: d for d in map(json.loads, drafted.read_text().splitlines())},
            "verifies": [o["meta_info"].get("spec_verify_ct", 0) for o in out[0]],
        }

    for label in ("whole", "radix"):
        for target, drafts in runs[label]["prefills"]:
            assert drafts == [target] * STEPS, (label, target, drafts)
    for (prefix, new), drafts in runs["tail"]["prefills"]:
        tails = [min(n, window + 1) for n in new]
        assert drafts == [([p + n - t for p, n, t in zip(prefix, new, tails)], tails)] * STEPS, (prefix, new, drafts)
    assert any(min(n, window + 1) < n for (_, new), _ in runs["tail"]["prefills"] for n in new)  # some were cut
    assert any(p > 0 for ((prefix, _), _) in runs["radix"]["prefills"] for p in prefix)  # the second round hit the cache

    # The first drafts of each prompt of the first round (lengths differ), from its prefill's last rows.
    for label in ("tail", "radix"):
        drafts = {n: runs[label]["drafts"][n] for n in map(len, first)}
        for length, whole in runs["whole"]["drafts"].items():
            assert drafts[length]["tokens"] == whole["tokens"], (label, length)
            torch.testing.assert_close(torch.tensor(drafts[length]["probs"]), torch.tensor(whole["probs"]), rtol=1e-5, atol=1e-6)
    assert runs["tail"]["verifies"] == runs["whole"]["verifies"], runs
    assert sum(runs["tail"]["verifies"]) < len(first) * (NEW_TOKENS - 1)  # drafts were accepted
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"


def test_multi_layer_eagle_through_hal_is_lossless_and_accepts_like_hal(
    checkpoint: tuple[Path, list[list[int]], Path], sgl_kernel_calls: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, expected, _ = checkpoint
    monkeypatch.setenv("SGLANG_PLATFORM", "hal")
    forwards = tmp_path / "hal_forwards.txt"
    monkeypatch.setenv("HAL_SGLANG_FORWARD_LOG", str(forwards))
    spec = sglang_generate(model, speculative=True)
    served = Counter(tuple(line.split()) for line in forwards.read_text().splitlines())
    plain = sglang_generate(model, speculative=False)

    tokens = [o["output_ids"] for o in spec]
    assert tokens == [o["output_ids"] for o in plain] == expected

    # hal generate --speculative mtp on the same checkpoint: the same tokens and accept length.
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    run = subprocess.run(
        [sys.executable, "-m", "hal.tools.cli", "generate", "--model", str(model), "--prompts-file", str(prompts),
         "--max-new-tokens", str(NEW_TOKENS), "--speculative", "mtp", "--num-draft-steps", str(STEPS), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    hal_run = json.loads(run.stdout)
    assert hal_run["tokens"] == expected
    # Both verify each request equally often: the same drafts are accepted. Accept length as
    # tokens per verify, bonus included, from tokens kept (the first token of each request comes
    # from prefill; hal's own figure also counts what a last verify accepted past the limit).
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in spec)
    assert verifies == hal_run["request_verifies"]
    sglang_accept = sum(len(t) - 1 for t in tokens) / verifies
    hal_accept = sum(len(t) - 1 for t in hal_run["tokens"]) / hal_run["request_verifies"]
    assert round(sglang_accept, 1) == round(hal_accept, 1), (sglang_accept, hal_accept, hal_run["accept_length"])
    assert sglang_accept > 2.0  # the distilled MTP layers do draft the target's tokens

    # Every target verify (one batch per step, as long as the longest-verifying request lives) and
    # the draft extends of every MTP layer went through hal, over hybrid SWA pools.
    steps = max(o["meta_info"]["spec_verify_ct"] for o in spec)
    assert served[("TARGET_VERIFY", "SWAKVPool")] == steps, served
    assert served[("DRAFT_EXTEND_V2", "SWAKVPool")] >= STEPS * steps, served
    assert {mode for mode, _ in served} <= {"EXTEND", "DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2"}
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"


@pytest.mark.parametrize("page_size", [16, 128])
def test_multi_layer_eagle_through_hal_with_pages_equals_one_token_pages(
    checkpoint: tuple[Path, list[list[int]], Path], sgl_kernel_calls: Path, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages of 16 and 128 tokens (hal's npu default): each request's last slot comes from the
    patched allocation helper, the verify and draft reservations span page boundaries, and the
    tokens are transformers' (which the one-token-page run above equals)."""
    model, expected, _ = checkpoint
    monkeypatch.setenv("SGLANG_PLATFORM", "hal")
    spec = sglang_generate(model, speculative=True, page_size=page_size)
    assert [o["output_ids"] for o in spec] == expected
    assert sum(o["meta_info"]["spec_verify_ct"] for o in spec) < len(PROMPTS) * NEW_TOKENS  # drafts were accepted
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"


def test_multi_layer_eagle_through_hal_at_tp2_equals_tp1(
    checkpoint: tuple[Path, list[list[int]], Path], sgl_kernel_calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks over gloo: q heads split, the full layers' one kv head replicated, hybrid pools and
    MTP layers on each rank; float32, so the tokens are transformers' exactly."""
    model, expected, _ = checkpoint
    monkeypatch.setenv("SGLANG_PLATFORM", "hal")
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")  # SGLang's CPU scheduler binds one core set per rank
    spec = sglang_generate(model, speculative=True, tp_size=2)
    assert [o["output_ids"] for o in spec] == expected
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_multi_layer_eagle_through_hal_in_low_precision_keeps_the_guarantee(
    checkpoint: tuple[Path, list[list[int]], Path], sgl_kernel_calls: Path, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's own default dtypes (fp16 on a CPU, bf16 on devices): MTP through hal departs from
    transformers' float32 tokens only where rounding explains it (README: low precision)."""
    from low_precision_guarantee import Guarantee
    from tiny_mimo_checkpoints import hf_load

    model, expected, hf_dir = checkpoint
    monkeypatch.setenv("SGLANG_PLATFORM", "hal")
    spec = [o["output_ids"] for o in sglang_generate(model, speculative=True, dtype=str(dtype).removeprefix("torch."))]
    guarantee = Guarantee(hf_dir, hf_load(hf_dir), dtype, PROMPTS, NEW_TOKENS)
    assert guarantee.reference == expected
    departures = [guarantee.check_departure(i, tokens, expected[i], f"SGLang {dtype}") for i, tokens in enumerate(spec)]
    print(f"SGLang {dtype}: tokens before the first departure from float32: {departures} of {NEW_TOKENS}")
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"


def on_emulated_ascend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The engines this test starts run hal's platform on hal's emulated Ascend backend; the file
    their processes log the emulated calls to (``site/``)."""
    calls = tmp_path / "npu_emulator_calls.txt"
    for name, value in (("SGLANG_PLATFORM", "hal"), ("HAL_SGLANG_DEVICE", "npu"), ("HAL_SGLANG_EMULATE", "1"),
                        ("HAL_NPU_EMULATOR_LOG", str(calls))):
        monkeypatch.setenv(name, value)
    return calls


def npu_emulator_calls(log: Path) -> Counter[str]:
    """What hal's emulated Ascend runtime ran, counted over every SGLang process (``site/``)."""
    return Counter(log.read_text().split()) if log.exists() else Counter()


@pytest.mark.parametrize(("dtype", "steps", "graphs"), [(torch.bfloat16, STEPS, True), (torch.float16, 1, False)],
                         ids=["bf16-3steps-npugraphs", "fp16-1step-eager"])
def test_sglang_on_hals_emulated_ascend_backend_serves_mimo_and_its_mtp(
    checkpoint: tuple[Path, list[list[int]], Path], sgl_kernel_calls: Path, dtype: torch.dtype, steps: int, graphs: bool,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seed's scenario on hal's Ascend backend: ``SGLANG_PLATFORM=hal HAL_SGLANG_DEVICE=npu
    HAL_SGLANG_EMULATE=1``. SGLang runs on the CPU (the emulator is the backend's own: no torch_npu
    in any process, so neither SGLang nor transformers takes an Ascend path) while every attention
    call of the prefill, the decode, the target verify and the MTP draft extends is an FIA v2 call
    and every K/V write an ``npu_scatter_nd_update_`` into hal's split pools, pages of 128 (the
    npu default). EAGLE equals plain decoding in the same dtype, or departs from it at a rounding
    tie; both keep the low-precision guarantee against transformers in float32. With graphs, SGLang's
    decode and target-verify graph runner captures on hal's graph backend (NPUGraph; SGLang's CPU path
    with the patches in ``patches/``), and every replay re-issues FIA's host-side lengths
    (``graph.update``); the batch sizes decoding runs at are captured, so decode steps replay."""
    from low_precision_guarantee import Guarantee
    from tiny_mimo_checkpoints import hf_load

    model, expected, hf_dir = checkpoint
    calls = on_emulated_ascend(monkeypatch, tmp_path)
    name = str(dtype).removeprefix("torch.")
    engine = {"dtype": name, "page_size": 128, "disable_cuda_graph": not graphs, "cuda_graph_bs_decode": list(range(1, len(PROMPTS) + 1))}
    plain = [o["output_ids"] for o in sglang_generate(model, speculative=False, **engine)]
    plain_calls = npu_emulator_calls(calls)
    calls.unlink()
    spec_out = sglang_generate(model, speculative=True, speculative_num_steps=steps, speculative_num_draft_tokens=steps + 1, **engine)
    spec = [o["output_ids"] for o in spec_out]
    spec_calls = npu_emulator_calls(calls)
    verifies = sum(o["meta_info"]["spec_verify_ct"] for o in spec_out)
    verify_steps = max(o["meta_info"]["spec_verify_ct"] for o in spec_out)

    layers = TinyConfig().num_layers
    for served in (plain_calls, spec_calls):
        assert served["FIA"] > layers and served["SCATTER"] == 2 * served["FIA"], served  # K and V: a buffer each
    if graphs:
        # Decode: the prefill eager, then every one of the NEW_TOKENS - 1 steps a replay that took
        # its FIA lengths; verify: every verify step replays (the draft extends run eagerly).
        assert plain_calls["CAPTURE"] >= 1 and plain_calls["REPLAY"] == plain_calls["UPDATE"] == NEW_TOKENS - 1, plain_calls
        assert spec_calls["CAPTURE"] >= 1 and spec_calls["REPLAY"] == spec_calls["UPDATE"] == verify_steps, spec_calls
    else:
        assert plain_calls["FIA"] == layers * NEW_TOKENS, plain_calls  # one call per layer and forward
        assert not plain_calls["CAPTURE"] and not spec_calls["CAPTURE"], (plain_calls, spec_calls)
    assert verifies < len(PROMPTS) * (NEW_TOKENS - 1)  # drafts were accepted

    guarantee = Guarantee(hf_dir, hf_load(hf_dir), dtype, PROMPTS, NEW_TOKENS)
    assert guarantee.reference == expected
    for i in range(len(PROMPTS)):
        guarantee.check_departure(i, spec[i], plain[i], f"SGLang on the emulated npu, {name}, EAGLE vs plain")
        guarantee.check_departure(i, plain[i], expected[i], f"SGLang on the emulated npu, {name}, plain vs float32")
    print(f"{name}, {steps} steps: accept length {sum(len(t) - 1 for t in spec) / verifies:.2f}, "
          f"EAGLE equals plain: {spec == plain}, emulated calls {dict(spec_calls)}")
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"


def test_sglang_on_hals_emulated_ascend_backend_at_tp2_keeps_tp1s_tokens_within_the_guarantee(
    checkpoint: tuple[Path, list[list[int]], Path], sgl_kernel_calls: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks over gloo, each serving its share of the heads with its own emulated Ascend
    backend (FIA v2 per rank): multi-layer EAGLE in bf16 gives tp 1's tokens up to the low-precision
    guarantee. Two ranks sum their halves of each row-parallel linear in another order than one
    rank does, so in bf16 a near-tie may go the other way (on CPUs whose bf16 matmuls run on AMX it
    does, at one token of 96); where the two runs first differ, both tokens must be within
    transformers' bf16 rounding of each other and of the float32 best (README: low precision)."""
    from low_precision_guarantee import Guarantee
    from tiny_mimo_checkpoints import hf_load

    model, expected, hf_dir = checkpoint
    calls = on_emulated_ascend(monkeypatch, tmp_path)
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")  # SGLang's CPU scheduler binds one core set per rank
    one = [o["output_ids"] for o in sglang_generate(model, speculative=True, dtype="bfloat16", page_size=128)]
    one_calls = npu_emulator_calls(calls)
    calls.unlink()
    two = [o["output_ids"] for o in sglang_generate(model, speculative=True, dtype="bfloat16", page_size=128, tp_size=2)]
    two_calls = npu_emulator_calls(calls)
    guarantee = Guarantee(hf_dir, hf_load(hf_dir), torch.bfloat16, PROMPTS, NEW_TOKENS)
    assert guarantee.reference == expected
    for i in range(len(PROMPTS)):
        guarantee.check_departure(i, two[i], one[i], "SGLang on the emulated npu, EAGLE at tp 2 vs tp 1")
    print(f"tp 2 equals tp 1: {two == one}")
    assert one_calls["FIA"] > 0 and two_calls["FIA"] == 2 * one_calls["FIA"], (one_calls, two_calls)  # every call on each rank
    assert not sgl_kernel_calls.exists(), f"placeholder sgl_kernel called: {sgl_kernel_calls.read_text()}"
