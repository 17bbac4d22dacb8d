"""``hal generate`` on a tiny MiMo-V2-Flash checkpoint made by transformers (with MTP layers added)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hal.tools.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tiny_mimo_checkpoints import add_mtp_layers, hf_load, make_checkpoint  # noqa: E402  (after the importorskips)

PROMPTS = [[3, 7, 11, 2, 9, 14, 5, 8], [4, 5]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    directory = tmp_path_factory.mktemp("mimo")
    hf = make_checkpoint(directory, num_hidden_layers=6, sliding_window=5)
    add_mtp_layers(directory, 2)
    expected = []
    for prompt in PROMPTS:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    return directory, expected


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    (line,) = out.strip().splitlines()  # exactly one JSON object on stdout
    return json.loads(line)


def test_json_tokens_equal_transformers_greedy_and_mtp(checkpoint, tmp_path: Path, capsys) -> None:
    directory, expected = checkpoint
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    plain = run_json(capsys, "--model", str(directory), "--prompts-file", str(prompts_file), "--max-new-tokens", "20")
    assert plain["tokens"] == expected and plain["accept_length"] is None
    assert plain["target_forwards"] == 20 and plain["tokens_per_second"] > 0
    mtp = run_json(capsys, "--model", str(directory), "--prompts-file", str(prompts_file), "--max-new-tokens", "20",
                   "--speculative", "mtp", "--num-draft-steps", "2")
    assert mtp["tokens"] == expected and 1.0 <= mtp["accept_length"] <= 3.0
    single = run_json(capsys, "--model", str(directory), "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "20")
    assert single["tokens"] == expected[:1]


def test_text_prompts_go_through_the_tokenizer(checkpoint, tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory, _ = checkpoint
    vocab = {w: i for i, w in enumerate(["<unk>", "x", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    try:
        by_text = run_json(capsys, "--model", str(directory), "--prompt", "b f i a", "--max-new-tokens", "6")
        by_ids = run_json(capsys, "--model", str(directory), "--prompt-ids", "3,7,10,2", "--max-new-tokens", "6")
        assert by_text["tokens"] == by_ids["tokens"]
    finally:
        (directory / "tokenizer.json").unlink()


def test_errors_are_one_line(checkpoint, capsys) -> None:
    directory, _ = checkpoint
    assert main(["generate", "--model", str(directory), "--prompt-ids", "1,2", "--prompt", "a"]) == 1
    assert "exactly one of --prompt-ids, --prompts-file, --prompt" in capsys.readouterr().err
    assert main(["generate", "--model", str(directory), "--prompt", "a b"]) == 1
    assert "tokenizer.json" in capsys.readouterr().err
    assert main(["generate", "--model", str(directory), "--prompt-ids", "1,2", "--speculative", "mtp", "--num-draft-steps", "3"]) == 1
    assert "needs 1..2" in capsys.readouterr().err
    assert main(["generate", "--model", str(directory / "nope"), "--prompt-ids", "1"]) == 1
    assert "CheckpointError: --model " in (err := capsys.readouterr().err) and "nope: no such directory" in err


def _copy_with_config(directory: Path, target: Path, **changes: object) -> Path:
    target.mkdir()
    for file in directory.iterdir():
        if file.suffix == ".safetensors":
            (target / file.name).symlink_to(file)
    config = {**json.loads((directory / "config.json").read_text()), **changes}
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_list_of_eos_ids_stops_at_any_of_them_like_transformers(checkpoint, tmp_path: Path, capsys) -> None:
    directory, expected = checkpoint
    stop = expected[0][5]  # a token greedy decoding of prompt 0 really produces; 95 is one it never does
    assert 95 not in expected[0][:6]
    copy = _copy_with_config(directory, tmp_path / "eos", eos_token_id=[95, stop])
    hf = hf_load(copy)
    for prompt in PROMPTS:
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=[95, stop])[0, len(prompt):]
        got = run_json(capsys, "--model", str(copy), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "20")
        assert got["tokens"][0] == reference.tolist()
        for_mtp = run_json(capsys, "--model", str(copy), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "20",
                           "--speculative", "mtp", "--num-draft-steps", "2")
        assert for_mtp["tokens"] == got["tokens"]
    assert got_first_stop(run_json(capsys, "--model", str(copy), "--prompt-ids", ",".join(map(str, PROMPTS[0])))) == stop


def got_first_stop(result: dict) -> int:
    (tokens,) = result["tokens"]
    return int(tokens[-1])


def test_dtype_loads_the_weights_in_it(checkpoint, capsys, monkeypatch) -> None:
    from hal.speculative.mimo import MiMoV2Flash

    directory, _ = checkpoint
    loaded: list[MiMoV2Flash] = []
    original = MiMoV2Flash.from_pretrained.__func__  # type: ignore[attr-defined]

    def recording(cls, *args, **kwargs):  # the CLI's model, to read its weights afterwards
        loaded.append(original(cls, *args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(MiMoV2Flash, "from_pretrained", classmethod(recording))
    hf = hf_load(directory, dtype=torch.bfloat16)
    prompt = PROMPTS[0]
    reference = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(prompt):]
    got = run_json(capsys, "--model", str(directory), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "12",
                   "--dtype", "bfloat16", "--kv-dtype", "bfloat16")
    assert got["tokens"][0] == reference.tolist()
    run_json(capsys, "--model", str(directory), "--prompt-ids", "1,2", "--max-new-tokens", "1")  # auto: the CPU backend's float32
    bf16, auto = loaded
    for name, weight in bf16.state_dict().items():
        if "gate_weight" not in name and "e_score_correction_bias" not in name:  # the router stays float32
            assert weight.dtype == torch.bfloat16, name
    reference_weights = hf.state_dict()
    for name, weight in (("model.layers.1.self_attn.q_proj.weight", bf16.layers[1].self_attn.q_proj.weight),
                         ("lm_head.weight", bf16.lm_head.weight)):
        assert torch.equal(weight, reference_weights[name]), name  # transformers' bf16 weights, bit for bit
    assert {p.dtype for p in auto.parameters()} == {torch.float32}


def test_the_device_string_is_resolved_once_and_the_engine_gets_that_backend(checkpoint, capsys, monkeypatch) -> None:
    """``--device`` is parsed once, at the edge; the engine runs on the backend object resolved there."""
    import hal.registry
    from hal.speculative.engine import TargetEngine

    directory, expected = checkpoint
    parsed: list[object] = []
    resolved: list[object] = []
    original_parse, original_get = hal.registry.parse_device, hal.registry.get_backend
    monkeypatch.setattr(hal.registry, "parse_device", lambda device: parsed.append(device) or original_parse(device))
    monkeypatch.setattr(hal.registry, "get_backend", lambda *a, **k: resolved.append(original_get(*a, **k)) or resolved[-1])
    engines: list[TargetEngine] = []
    original_init = TargetEngine.__init__

    def init(self, model, backend="cpu", **kwargs):  # type: ignore[no-untyped-def]
        original_init(self, model, backend, **kwargs)
        engines.append(self)

    monkeypatch.setattr(TargetEngine, "__init__", init)
    got = run_json(capsys, "--model", str(directory), "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", "20",
                   "--speculative", "mtp", "--num-draft-steps", "2")
    assert got["tokens"] == expected[:1]
    assert parsed == ["cpu"] and len(resolved) == 1
    assert [engine.backend for engine in engines] == resolved


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_mtp_with_default_options_runs_in_the_backends_dtype(device: str, tmp_path: Path, capsys) -> None:
    """``hal generate --speculative mtp`` with every other option at its default: bf16 weights and KV
    on the emulated npu (``--dtype auto``), and ``--dtype bfloat16`` on the cpu; the tokens keep the
    low-precision guarantee against transformers in float32."""
    from low_precision_guarantee import Guarantee

    make_checkpoint(tmp_path, num_hidden_layers=6, sliding_window=5, head_dim=128, v_head_dim=128, hidden_size=64,
                    initializer_range=0.1)
    add_mtp_layers(tmp_path, 3)
    options = ["--device", "npu", "--emulate"] if device == "npu" else ["--dtype", "bfloat16"]
    got = run_json(capsys, "--model", str(tmp_path), "--prompt-ids", ",".join(map(str, PROMPTS[0])),
                   "--speculative", "mtp", "--num-draft-steps", "3", *options)
    guarantee = Guarantee(tmp_path, hf_load(tmp_path), torch.bfloat16, PROMPTS[:1], 32)  # 32: generate's default
    assert len(got["tokens"][0]) == 32
    guarantee.check_departure(0, got["tokens"][0], guarantee.reference[0], f"hal generate on {device}")


def test_draft_step_refusals_come_before_any_weight_loads(checkpoint, capsys, monkeypatch) -> None:
    from hal.speculative.mimo import MiMoV2Flash

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the options were checked")

    monkeypatch.setattr(MiMoV2Flash, "from_pretrained", no_loading)
    directory, _ = checkpoint
    assert main(["generate", "--model", str(directory), "--prompt-ids", "1,2", "--speculative", "mtp", "--num-draft-steps", "3"]) == 1
    assert "--num-draft-steps 3: --speculative mtp needs 1..2" in capsys.readouterr().err
    assert main(["generate", "--model", str(directory), "--prompt-ids", "1,2", "--num-draft-steps", "2"]) == 1
    assert "--num-draft-steps 2 needs --speculative mtp" in capsys.readouterr().err
