"""MiMo-V2-Flash checkpoints: config forms, the safetensors loader, and the model on hal against
transformers' independent ``MiMoV2FlashForCausalLM`` (tiny checkpoints made with ``save_pretrained``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import hal

from hal.errors import CheckpointError
from hal.speculative import GreedyDecoder
from hal.speculative.checkpoint import SCALE_SUFFIX, Checkpoint, dequantize_fp8, quantize_fp8
from hal.speculative.mimo import MiMoV2Flash
from hal.speculative.mimo_config import MiMoConfig

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tiny_mimo_checkpoints import add_mtp_layers, hf_load, make_checkpoint  # noqa: E402  (after the importorskips)

CONFIGS = {
    # hybrid pattern of the real model (full at 0 and every 6th), window shorter than the prompts
    "hybrid w5": dict(num_hidden_layers=6, sliding_window=5),
    # SWA first, GQA 4 on full layers, 2 on SWA layers, other routing groups
    "swa-first w9": dict(num_hidden_layers=3, sliding_window=9, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         mlp_layer_types=["dense", "sparse", "dense"], n_group=2, topk_group=1, num_experts_per_tok=3),
    # GQA 2 on full layers, none on SWA layers (8 q, 8 kv), qk 32 / v 16, ungrouped, unnormalised routing
    "mha qk32 v16": dict(num_hidden_layers=2, num_key_value_heads=4, num_attention_heads=8, head_dim=32, v_head_dim=16,
                         sliding_window=3, n_group=1, topk_group=1, norm_topk_prob=False),
    # every layer full attention with kv heads == q heads (the unused SWA shape would have 2x), q/k/v biases
    "all full, bias": dict(num_hidden_layers=2, layer_types=["full_attention"] * 2, num_key_value_heads=4, attention_bias=True),
    # lm_head tied to the embedding (transformers stores no lm_head.weight)
    "tied w5": dict(num_hidden_layers=2, sliding_window=5, tie_word_embeddings=True),
    # transformers' sliding_window=1: each position sees only itself (hal's W = 0)
    "w1": dict(num_hidden_layers=6, sliding_window=1),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, MiMoV2Flash, str]:
    directory = tmp_path_factory.mktemp(request.param.replace(" ", "_"))
    make_checkpoint(directory, **CONFIGS[request.param])
    return hf_load(directory), MiMoV2Flash.from_pretrained(directory), request.param


# ------------------------------------------------------------------------------------------------
# config forms and the window convention


def test_transformers_and_published_forms_give_one_config(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, num_hidden_layers=6, sliding_window=5)
    raw = json.loads((tmp_path / "config.json").read_text())
    from_transformers = MiMoConfig.from_dict(raw)
    published = {
        "model_type": "mimo_v2_flash", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 6,
        "hybrid_layer_pattern": [0, 1, 1, 1, 1, 0], "moe_layer_freq": [0, 1, 1, 1, 1, 1],
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "v_head_dim": 8,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16, "swa_v_head_dim": 8,
        "sliding_window_size": 4, "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
        "attention_value_scale": 0.707, "rope_theta": 5_000_000, "swa_rope_theta": 10_000, "partial_rotary_factor": 0.334,
        "layernorm_epsilon": 1e-5, "n_routed_experts": 8, "moe_intermediate_size": 24, "num_experts_per_tok": 2,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "n_shared_experts": None, "tie_word_embeddings": False, "max_position_embeddings": 512,
    }  # fmt: skip
    assert MiMoConfig.from_dict(published) == from_transformers
    # ... and hal writes that published form back, key for key (what SGLang's MiMo reads)
    written = from_transformers.published_dict()
    assert {k: written[k] for k in published} == published
    assert MiMoConfig.from_dict(written) == from_transformers
    # hal's W: transformers' sliding_window w keeps w keys (p - w + 1 .. p); published S keeps S + 1
    assert from_transformers.sliding_window == 4 == published["sliding_window_size"] == raw["sliding_window"] - 1
    assert from_transformers.swa.num_kv_heads == 2 and from_transformers.full.num_kv_heads == 1
    assert from_transformers.swa.has_sinks and not from_transformers.full.has_sinks
    assert from_transformers.swa.rotary_dim == int(16 * 0.334)


@pytest.mark.parametrize(("eos", "ids"), [(None, ()), (7, (7,)), ([7, 9], (7, 9)), ([], ())])
def test_eos_ids_and_attention_bias_survive_both_forms(tmp_path: Path, eos: Any, ids: tuple[int, ...]) -> None:
    make_checkpoint(tmp_path, num_hidden_layers=2, sliding_window=5, attention_bias=True)
    raw = {**json.loads((tmp_path / "config.json").read_text()), "eos_token_id": eos}
    config = MiMoConfig.from_dict(raw)
    assert config.eos_token_ids == ids and config.attention_bias
    assert MiMoConfig.from_dict(config.published_dict()) == config


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"model_type": "llama"}, "model_type 'llama' is not supported"),
        ({"layer_types": ["full_attention", "chunked"]}, "layer_types has entries ['chunked']"),
        ({"n_routed_experts": 6}, "n_routed_experts=6"),
        ({"hidden_size": "32"}, "hidden_size='32' must be an int"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope_type='yarn' is not supported"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of the full-attention kv heads 3"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported, expected 'silu'"),
        ({"eos_token_id": [2, "3"]}, "eos_token_id=[2, '3'] must be a token id or a list of token ids"),
        ({"attention_bias": "yes"}, "attention_bias='yes' must be a bool"),
        # MTP layers attend over the sliding window, so a model without SWA layers still needs one
        ({"layer_types": ["full_attention"] * 2, "num_nextn_predict_layers": 1, "sliding_window": 0}, "sliding_window=0"),
    ],
)
def test_bad_config_values_are_named(tmp_path: Path, change: dict[str, Any], names: str) -> None:
    make_checkpoint(tmp_path, num_hidden_layers=2, sliding_window=5)
    raw = {**json.loads((tmp_path / "config.json").read_text()), **change}
    if "layer_types" in change:
        raw["num_hidden_layers"] = 2
    with pytest.raises(CheckpointError) as info:
        MiMoConfig.from_dict(raw)
    assert names in str(info.value)


# ------------------------------------------------------------------------------------------------
# the loader


def test_loader_errors_name_the_thing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing checkpoint directory"):
        MiMoV2Flash.from_pretrained(tmp_path / "nope")
    make_checkpoint(tmp_path, num_hidden_layers=2, sliding_window=5)
    weights = safetensors_torch.load_file(tmp_path / "model.safetensors")

    def rewrite(tensors: dict[str, torch.Tensor]) -> None:
        safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")

    rewrite({k: v for k, v in weights.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"})
    with pytest.raises(CheckpointError, match=r"missing tensors .*model.layers.1.mlp.experts.3.up_proj.weight"):
        MiMoV2Flash.from_pretrained(tmp_path)
    rewrite({**weights, "model.layers.1.self_attn.rotary.inv_freq": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected tensors .*model.layers.1.self_attn.rotary.inv_freq"):
        MiMoV2Flash.from_pretrained(tmp_path)
    rewrite({**weights, "model.norm.weight": torch.ones(33)})
    with pytest.raises(CheckpointError, match=r"tensor 'model.norm.weight': shape mismatch, expected \(32,\), found \(33,\)"):
        MiMoV2Flash.from_pretrained(tmp_path)
    name = "model.layers.1.self_attn.q_proj.weight"
    for stored in (weights[name].to(torch.int32), weights[name] > 0):  # loaded silently (cast) before
        rewrite({**weights, name: stored})
        with pytest.raises(CheckpointError, match=f"tensor '{name}' is stored as {stored.dtype}; weights are floating point"):
            MiMoV2Flash.from_pretrained(tmp_path)
    for bad in (float("nan"), float("inf")):  # generated [0, 0, 0, ...] with exit code 0 before
        poisoned = weights[name].clone()
        poisoned[1, 2] = bad
        rewrite({**weights, name: poisoned})
        with pytest.raises(CheckpointError, match=f"tensor '{name}' holds 1 NaN or inf values"):
            MiMoV2Flash.from_pretrained(tmp_path)
    for damaged in (b"", b"x" * 20, (tmp_path / "model.safetensors").read_bytes()[:100]):  # a traceback before
        (tmp_path / "model.safetensors").write_bytes(damaged)
        with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
            MiMoV2Flash.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing file: .*model.safetensors"):
        MiMoV2Flash.from_pretrained(tmp_path)


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "one", num_hidden_layers=2, sliding_window=5)
    make_checkpoint(tmp_path / "many", num_hidden_layers=2, sliding_window=5, _shard="20KB")
    assert len(list((tmp_path / "many").glob("model-*.safetensors"))) > 1
    one, many = MiMoV2Flash.from_pretrained(tmp_path / "one"), MiMoV2Flash.from_pretrained(tmp_path / "many")
    for (name, a), (_, b) in zip(one.state_dict().items(), many.state_dict().items()):
        assert torch.equal(a, b), name
    shard = sorted((tmp_path / "many").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing file: .*{shard.name}"):
        MiMoV2Flash.from_pretrained(tmp_path / "many")


def test_an_index_naming_the_wrong_shard_is_a_checkpoint_error(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, num_hidden_layers=2, sliding_window=5, _shard="20KB")
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.norm.weight"
    wrong = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}': cannot be read from .*{wrong}"):
        MiMoV2Flash.from_pretrained(tmp_path)


def test_tied_embeddings_share_one_parameter_and_refuse_a_stored_lm_head(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, num_hidden_layers=2, sliding_window=5, tie_word_embeddings=True)
    model = MiMoV2Flash.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight.dtype == torch.bfloat16
    weights = safetensors_torch.load_file(tmp_path / "model.safetensors")
    safetensors_torch.save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"] * 2}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="stores lm_head.weight, but config.json says tie_word_embeddings=true"):
        MiMoV2Flash.from_pretrained(tmp_path)


def test_fp8_block_scaled_weights_dequantize_to_scale_times_value(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, num_hidden_layers=2, sliding_window=5, hidden_size=160, intermediate_size=200)
    weights = safetensors_torch.load_file(tmp_path / "model.safetensors")
    quantized = dict(weights)
    for name, w in weights.items():
        if name.endswith("proj.weight") and w.dim() == 2:
            quantized[name], quantized[name + SCALE_SUFFIX] = quantize_fp8(w)
    safetensors_torch.save_file(quantized, tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.gate_proj.weight"  # 200 x 160: ragged last blocks both ways
    value, scale_inv = quantized[name], quantized[name + SCALE_SUFFIX]
    assert value.dtype == torch.float8_e4m3fn and tuple(scale_inv.shape) == (2, 2)
    by_definition = torch.empty(200, 160)
    for i in range(200):
        for j in range(0, 160, 32):  # column runs that stay inside one 128-wide block
            by_definition[i, j : j + 32] = value[i, j : j + 32].float() * scale_inv[i // 128, j // 128]
    with Checkpoint(tmp_path) as ckpt:
        assert torch.equal(ckpt.tensor(name), by_definition)
        assert name + SCALE_SUFFIX not in ckpt.names
    model = MiMoV2Flash.from_pretrained(tmp_path)
    assert torch.equal(model.layers[0].mlp.gate_proj.weight, by_definition)
    assert (model.layers[0].mlp.gate_proj.weight - weights[name]).abs().max() < 0.07 * weights[name].abs().max()
    with pytest.raises(CheckpointError, match=r"shape mismatch, expected \(2, 2\)"):
        dequantize_fp8(value, scale_inv[:1], name)


# ------------------------------------------------------------------------------------------------
# the model on hal against transformers


PROMPTS = [[3, 7, 11, 2, 9, 14, 5, 8, 1, 40, 41, 12], [5, 6, 7], list(range(20, 45))]


def hal_logits(decoder: GreedyDecoder, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits of the prompt (one EXTEND) and of each continuation token (one DECODE each), through
    the decoder's hal kernel over its paged pool: rows ``len(prompt) + len(continuation)``."""
    from hal.spec import ForwardMode
    from hal.speculative.engine import KernelAttend

    model, requests = decoder.model, decoder._new_requests([prompt], len(continuation) + 1)
    rows = []
    try:
        _, hidden, _, _, _ = decoder._prefill_target(requests)
        rows.append(model.logits(hidden))
        requests[0].committed = len(prompt)
        for token in continuation:
            md = decoder._metadata(ForwardMode.DECODE, requests, [1])
            ids = torch.tensor([token], device=decoder.device)
            rows.append(model.logits(model.target_hidden(ids, md.positions, KernelAttend(decoder.target_attention, md))))
            requests[0].committed += 1
    finally:
        decoder._finish(requests[0])
    return torch.cat(rows).float().cpu()


def test_prefill_and_decode_logits_match_transformers(pair: tuple[Any, MiMoV2Flash, str]) -> None:
    hf, ours, label = pair
    decoder = GreedyDecoder(ours, hal.get_backend("cpu"), max_batch_size=4, max_seq_len=128, graph_batch_sizes=[1])
    prompt, continuation = PROMPTS[2], [1, 2, 3, 60, 61, 62, 63, 5]  # runs past the window
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + continuation])).logits[0]
        got = hal_logits(decoder, prompt, continuation)
    worst = float((got - expected).abs().max())
    assert worst < 2e-5 * max(1.0, float(expected.abs().max())), (label, worst)


def test_greedy_tokens_equal_transformers_generate(pair: tuple[Any, MiMoV2Flash, str]) -> None:
    hf, ours, label = pair
    decoder = GreedyDecoder(ours, hal.get_backend("cpu"), max_batch_size=4, max_seq_len=128, graph_batch_sizes=[1, 2, 4])
    got = decoder.generate(PROMPTS, 64).tokens
    # transformers' sliding-window cache keeps no earlier key at sliding_window=1 and then departs
    # from its own forward (which sees the token itself); its uncached generate is the definition.
    use_cache = CONFIGS[label].get("sliding_window") != 1
    for prompt, tokens in zip(PROMPTS, got):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False, use_cache=use_cache)
        assert list(tokens) == out[0, len(prompt) :].tolist(), label


# ------------------------------------------------------------------------------------------------
# MTP layers under the published names: the worker stays lossless


def test_mtp_worker_on_a_mimo_checkpoint_is_lossless(tmp_path: Path) -> None:
    from hal.speculative import MultiLayerEagleWorker

    make_checkpoint(tmp_path, num_hidden_layers=6, sliding_window=5)
    add_mtp_layers(tmp_path, 3)
    model = MiMoV2Flash.from_pretrained(tmp_path)
    assert model.config.num_mtp_layers == 3  # counted from the stored layers
    plain = GreedyDecoder(model, hal.get_backend("cpu"), max_batch_size=4, max_seq_len=128, graph_batch_sizes=[1, 2, 4])
    expected = plain.generate(PROMPTS, 40).tokens
    for steps in (1, 2, 3):
        worker = MultiLayerEagleWorker(model, hal.get_backend("cpu"), num_steps=steps, max_batch_size=4, max_seq_len=128, graph_batch_sizes=[1, 2, 4])
        result = worker.generate(PROMPTS, 40)
        assert result.tokens == expected, steps
        assert result.target_forwards <= 41
    fewer = MiMoV2Flash.from_pretrained(tmp_path, num_mtp_layers=1)  # unused stored MTP layers are not "unexpected"
    assert len(fewer.mtp) == 1


def test_npu_emulated_logits_match_transformers_in_bf16(tmp_path: Path) -> None:

    hf = make_checkpoint(tmp_path, num_hidden_layers=6, sliding_window=5, head_dim=128, v_head_dim=128, hidden_size=64,
                         num_attention_heads=4, num_key_value_heads=1)
    model = MiMoV2Flash.from_pretrained(tmp_path)
    prompt, continuation = PROMPTS[2], [1, 2, 3, 60, 61, 62]
    with torch.no_grad():
        decoder = GreedyDecoder(model, hal.get_backend("npu", emulate=True), kv_dtype=torch.bfloat16, max_batch_size=2, max_seq_len=256,
                                graph_batch_sizes=[1])
        assert decoder.target_pool.spec.page_size == 128  # the NPU default
        got = hal_logits(decoder, prompt, continuation)
        expected = hf(torch.tensor([prompt + continuation])).logits[0]
    scale = float(expected.abs().max())
    worst = float((got - expected).abs().max())
    assert worst < 1.6e-2 * max(1.0, scale), worst  # bf16 attention: about two ulps at magnitude 1
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


# ------------------------------------------------------------------------------------------------
# hal demo --export: the demo's model is a checkpoint transformers loads


def test_demo_export_writes_a_checkpoint_transformers_loads(tmp_path: Path) -> None:
    import io

    from hal.tools import demo
    from hal.tools.cli import build_parser

    out = tmp_path / "demo-ckpt"
    args = build_parser().parse_args(["demo", "--train-steps", "5", "--train-sequences", "8", "--max-new-tokens", "6",
                                      "--batch-size", "2", "--no-cache", "--export", str(out)])
    assert demo.run(args, out=io.StringIO()) == 0
    hf = hf_load(out)
    ours = MiMoV2Flash.from_pretrained(out)
    assert ours.config.num_mtp_layers == 3 and ours.config.sliding_window == 16
    prompts = demo.make_prompts(2, ours.config.vocab_size, 0)
    got = GreedyDecoder(ours, hal.get_backend("cpu"), max_batch_size=2, max_seq_len=96, graph_batch_sizes=[2]).generate(prompts, 64).tokens
    for prompt, tokens in zip(prompts, got):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
        assert list(tokens) == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_weights_load_exactly(tmp_path: Path, stored: torch.dtype) -> None:
    make_checkpoint(tmp_path, num_hidden_layers=2, sliding_window=5)
    weights = {k: v.to(stored) for k, v in safetensors_torch.load_file(tmp_path / "model.safetensors").items()}
    safetensors_torch.save_file(weights, tmp_path / "model.safetensors")
    as_fp32 = MiMoV2Flash.from_pretrained(tmp_path)
    as_stored = MiMoV2Flash.from_pretrained(tmp_path, dtype=stored)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(as_fp32.layers[1].self_attn.q_proj.weight, weights[name].float())
    assert torch.equal(as_stored.layers[1].self_attn.q_proj.weight, weights[name])
    router = as_stored.layers[1].mlp
    assert router.gate_weight.dtype == torch.float32 and router.e_score_correction_bias.dtype == torch.float32


def test_mtp_worker_on_a_mimo_checkpoint_is_lossless_on_the_emulated_npu(tmp_path: Path) -> None:
    from hal.speculative import MultiLayerEagleWorker

    make_checkpoint(tmp_path, num_hidden_layers=6, sliding_window=5, head_dim=128, v_head_dim=128, hidden_size=64)
    add_mtp_layers(tmp_path, 2)
    model = MiMoV2Flash.from_pretrained(tmp_path)
    kwargs: dict[str, Any] = {"kv_dtype": torch.bfloat16, "max_batch_size": 4, "max_seq_len": 128,
                              "graph_batch_sizes": [4]}
    npu = hal.get_backend("npu", emulate=True)
    expected = GreedyDecoder(model, npu, **kwargs).generate(PROMPTS, 24).tokens
    for steps in (1, 2):
        got = MultiLayerEagleWorker(model, npu, num_steps=steps, **kwargs).generate(PROMPTS, 24).tokens
        assert got == expected, steps
