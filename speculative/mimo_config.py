"""MiMo-V2-Flash's config.json, in either of its two forms, as one normalised ``MiMoConfig``.

The published form (``hybrid_layer_pattern``, ``moe_layer_freq``, ``swa_*`` attention keys,
``sliding_window_size``, sink-bias switches, ``layernorm_epsilon``...) and the form transformers
writes (``layer_types``, ``mlp_layer_types``, ``rope_parameters``, ``sliding_window``) describe the same
model; both map onto the fields below.

Sliding windows, in hal's convention (a query at position ``p`` sees keys ``p - W .. p``):
- published ``sliding_window_size = S``: the reference attends to ``S`` previous tokens plus the
  query, so ``W = S``;
- transformers ``sliding_window = w``: its mask keeps keys ``j > p - w``, i.e. ``p - w + 1 .. p``,
  so ``W = w - 1`` (its config turns a published ``S`` into ``w = S + 1``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from hal.distributed import TPGroup
from hal.errors import CheckpointError, SpecError
from hal.spec import LayerSpec
from hal.speculative.contract import ModelSpec

MODEL_TYPE = "mimo_v2_flash"
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.334  # transformers' default when a rope entry names none


@attrs.frozen
class AttentionShape:
    """One layer type's attention: heads, head dims, RoPE and sinks."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    has_sinks: bool

    @property
    def rotary_dim(self) -> int:
        """Leading q/k dims that RoPE rotates (``int(head_dim * partial_rotary_factor)``, as transformers)."""
        return int(self.head_dim * self.partial_rotary_factor)


@attrs.frozen
class MiMoConfig:
    """Everything hal's MiMo-V2-Flash model needs from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLPs (layer 0 and the MTP layers)
    layer_is_swa: tuple[bool, ...]
    layer_is_moe: tuple[bool, ...]
    full: AttentionShape
    swa: AttentionShape
    sliding_window: int  # hal's W: keys p - W .. p
    attention_value_scale: float
    rms_norm_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_mtp_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False  # q/k/v projections carry biases (o_proj never does)

    def __attrs_post_init__(self) -> None:
        for kind, shape in self.used_shapes():
            if shape.num_q_heads % shape.num_kv_heads:
                raise CheckpointError(
                    f"config.json: num_attention_heads={shape.num_q_heads} is not a multiple of the {kind} kv heads "
                    f"{shape.num_kv_heads}"
                )
        if self.sliding_window < 0:  # W = 0 is a window too: each position sees only itself
            raise CheckpointError(f"config.json: the sliding window must be >= 0 (hal's W), got {self.sliding_window}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_is_swa)

    def used_shapes(self) -> list[tuple[str, AttentionShape]]:
        """The attention shapes some layer has: full if a target layer is full, sliding-window if a
        target layer is or there are MTP layers (their attention is SWA)."""
        used = [("full-attention", self.full)] if not all(self.layer_is_swa) else []
        if any(self.layer_is_swa) or self.num_mtp_layers:
            used.append(("sliding-window", self.swa))
        return used

    def attention(self, layer: int) -> AttentionShape:
        """The attention shape of target layer ``layer``."""
        return self.swa if self.layer_is_swa[layer] else self.full

    def target_layer_spec(self, layer: int) -> LayerSpec:
        """hal's view of target layer ``layer`` (its id in the target KV pool)."""
        return _layer_spec(layer, self.attention(layer), self.sliding_window if self.layer_is_swa[layer] else None)

    def mtp_layer_spec(self, step: int) -> LayerSpec:
        """MTP layer ``step``: SWA attention, layer ``step`` of the MTP pool."""
        return _layer_spec(step, self.swa, self.sliding_window)

    def model_spec(self, dtype: torch.dtype = torch.float32) -> ModelSpec:
        """What hal's engines read: sizes, every target and MTP layer as a ``LayerSpec``, and the
        compute dtype (the weights', ``dtype``)."""
        return ModelSpec(self.vocab_size, self.hidden_size, self.max_position_embeddings,
                         tuple(self.target_layer_spec(i) for i in range(self.num_layers)),
                         tuple(self.mtp_layer_spec(k) for k in range(self.num_mtp_layers)), dtype=dtype)

    def for_tensor_parallel(self, tp: TPGroup) -> MiMoConfig:
        """This rank's share: q heads and both MLP widths divided by the TP size; kv heads divided,
        or replicated (one per rank) when there are fewer than ranks. A count that does not divide
        is a ``SpecError`` naming it."""
        if tp.size == 1:
            return self
        shapes = {}
        for name, shape in (("full", self.full), ("swa", self.swa)):
            tp.shard(shape.num_q_heads, f"{name} attention's num_attention_heads")
            kv = shape.num_kv_heads
            if kv % tp.size and tp.size % kv:
                raise SpecError(f"tensor parallelism: {name} attention's num_key_value_heads={kv} neither divides by "
                                f"nor divides the TP size {tp.size}")
            shapes[name] = attrs.evolve(shape, num_q_heads=shape.num_q_heads // tp.size, num_kv_heads=max(kv // tp.size, 1))
        tp.shard(self.intermediate_size, "intermediate_size")
        tp.shard(self.moe_intermediate_size, "moe_intermediate_size")
        return attrs.evolve(self, full=shapes["full"], swa=shapes["swa"], intermediate_size=self.intermediate_size // tp.size,
                            moe_intermediate_size=self.moe_intermediate_size // tp.size)

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """K + V bytes one token takes over every target layer (the heads this config holds)."""
        return sum(shape.num_kv_heads * (shape.head_dim + shape.v_head_dim) * element_bytes
                   for shape in map(self.attention, range(self.num_layers)))

    def kv_head_shard(self, layer_type: str, tp: TPGroup) -> tuple[int, int]:
        """``(first kv head, count)`` this rank holds of ``layer_type``'s (``"full"``/``"swa"``) kv heads."""
        kv = (self.full if layer_type == "full" else self.swa).num_kv_heads
        if kv % tp.size == 0:
            return tp.shard(kv, "num_key_value_heads")
        return tp.rank // (tp.size // kv), 1  # replicated: ranks that share a kv head hold the same one

    def published_dict(self) -> dict[str, Any]:
        """This config as config.json in the published key names (what SGLang's ``models/mimo_v2.py``
        reads); ``from_dict`` of it gives this config back (MTP layers as ``num_nextn_predict_layers``)."""
        if self.full.partial_rotary_factor != self.swa.partial_rotary_factor:
            raise CheckpointError(
                f"config.json: the published form has one partial_rotary_factor, got {self.full.partial_rotary_factor} "
                f"(full) and {self.swa.partial_rotary_factor} (sliding-window)"
            )
        moe = bool(self.n_routed_experts)
        return {
            "architectures": ["MiMoV2FlashForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "hybrid_layer_pattern": [int(swa) for swa in self.layer_is_swa], "moe_layer_freq": [int(m) for m in self.layer_is_moe],
            "num_attention_heads": self.full.num_q_heads, "num_key_value_heads": self.full.num_kv_heads,
            "head_dim": self.full.head_dim, "v_head_dim": self.full.v_head_dim,
            "swa_num_attention_heads": self.swa.num_q_heads, "swa_num_key_value_heads": self.swa.num_kv_heads,
            "swa_head_dim": self.swa.head_dim, "swa_v_head_dim": self.swa.v_head_dim, "sliding_window_size": self.sliding_window,
            "add_full_attention_sink_bias": self.full.has_sinks, "add_swa_attention_sink_bias": self.swa.has_sinks,
            "attention_value_scale": self.attention_value_scale, "rope_theta": self.full.rope_theta,
            "swa_rope_theta": self.swa.rope_theta, "partial_rotary_factor": self.full.partial_rotary_factor,
            "layernorm_epsilon": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "eos_token_id": _published_eos(self.eos_token_ids),
            "num_nextn_predict_layers": self.num_mtp_layers, "hidden_act": "silu", "attention_bias": self.attention_bias,
            "n_group": self.n_group, "topk_group": self.topk_group, "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "n_shared_experts": None,
            # a dense model names no experts (transformers' defaults fill them)
            **({"n_routed_experts": self.n_routed_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size} if moe else {}),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, num_mtp_layers: int | None = None) -> MiMoConfig:
        """Either form of config.json; ``num_mtp_layers`` overrides the count the config gives (or 0)."""
        model_type = raw.get("model_type")
        if model_type != MODEL_TYPE:
            raise CheckpointError(f"config.json: model_type {model_type!r} is not supported, expected {MODEL_TYPE!r}")
        form = _TransformersForm(raw) if "layer_types" in raw else _PublishedForm(raw)
        return form.build(num_mtp_layers)

    @classmethod
    def from_file(cls, path: Path | str, *, num_mtp_layers: int | None = None) -> MiMoConfig:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"missing file: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw, num_mtp_layers=num_mtp_layers)


def _layer_spec(layer_id: int, shape: AttentionShape, window: int | None) -> LayerSpec:
    return LayerSpec(layer_id, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.v_head_dim,
                     scaling=shape.head_dim**-0.5, sliding_window=window, has_sinks=shape.has_sinks)


class _Form:
    """Typed access to one config dict; every error names the key."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = attrs.NOTHING) -> Any:
        if key not in self.raw or self.raw[key] is None:
            if default is attrs.NOTHING:
                raise CheckpointError(f"config.json: missing key {key!r}")
            return default
        value = self.raw[key]
        if isinstance(value, bool) and kind is not bool:
            raise CheckpointError(f"config.json: {key}={value!r} must be {_kind_name(kind)}")
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind):
            raise CheckpointError(f"config.json: {key}={value!r} must be {_kind_name(kind)}")
        return value

    def positive(self, key: str, default: Any = attrs.NOTHING) -> int:
        value = self.get(key, int, default)
        if value <= 0:
            raise CheckpointError(f"config.json: {key}={value} must be a positive int")
        return int(value)

    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id``: absent, one id or a list of ids (generation stops at any of them)."""
        eos = self.get("eos_token_id", (int, list), [])
        ids = [eos] if isinstance(eos, int) else eos
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise CheckpointError(f"config.json: eos_token_id={eos!r} must be a token id or a list of token ids")
        return tuple(ids)

    def moe(self) -> dict[str, Any]:
        experts = self.positive("n_routed_experts")
        top_k = self.positive("num_experts_per_tok")
        n_group, topk_group = self.positive("n_group", 1), self.positive("topk_group", 1)
        if experts % n_group or top_k > experts or topk_group > n_group:
            raise CheckpointError(
                f"config.json: n_routed_experts={experts}, num_experts_per_tok={top_k}, n_group={n_group}, "
                f"topk_group={topk_group}: experts must split into n_group groups, top-k <= experts, topk_group <= n_group"
            )
        if experts // n_group < 2:
            raise CheckpointError(f"config.json: group-limited routing scores each group by its top 2 experts; "
                                  f"n_routed_experts={experts} / n_group={n_group} leaves fewer than 2")
        if top_k > topk_group * (experts // n_group):
            raise CheckpointError(f"config.json: num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} groups")
        scaling = self.get("routed_scaling_factor", float, 1.0)
        if not math.isfinite(scaling) or scaling <= 0:
            raise CheckpointError(f"config.json: routed_scaling_factor={scaling} must be a positive, finite number")
        return {
            "n_routed_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": self.positive("moe_intermediate_size"),
            "n_group": n_group,
            "topk_group": topk_group,
            "norm_topk_prob": self.get("norm_topk_prob", bool, True),
            "routed_scaling_factor": scaling,
        }

    def common(self, layer_is_swa: tuple[bool, ...], layer_is_moe: tuple[bool, ...]) -> dict[str, Any]:
        n = len(layer_is_swa)
        if len(layer_is_moe) != n:
            raise CheckpointError(f"config.json: {len(layer_is_moe)} MLP layer types for {n} attention layer types")
        if "num_hidden_layers" in self.raw and self.positive("num_hidden_layers") != n:
            raise CheckpointError(f"config.json: num_hidden_layers={self.raw['num_hidden_layers']} but {n} layer types")
        activation = self.raw.get("hidden_act", "silu")
        if activation != "silu":  # hal's MLPs and experts compute SiLU
            raise CheckpointError(f"config.json: hidden_act={activation!r} is not supported, expected 'silu'")
        tie = self.get("tie_word_embeddings", bool, False)
        value_scale = self.get("attention_value_scale", float, 1.0)
        if not math.isfinite(value_scale):
            raise CheckpointError(f"config.json: attention_value_scale={value_scale} must be finite")
        return {
            "vocab_size": self.positive("vocab_size"),
            "hidden_size": self.positive("hidden_size"),
            "intermediate_size": self.positive("intermediate_size"),
            "layer_is_swa": layer_is_swa,
            "layer_is_moe": layer_is_moe,
            "attention_value_scale": value_scale,
            "max_position_embeddings": self.positive("max_position_embeddings", 131072),
            "tie_word_embeddings": tie,
            "eos_token_ids": self.eos_token_ids(),
            "attention_bias": self.get("attention_bias", bool, False),
            **(self.moe() if any(layer_is_moe) else _NO_MOE),
        }


_NO_MOE = {"n_routed_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0, "n_group": 1,
           "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0}


def _published_eos(ids: tuple[int, ...]) -> int | list[int] | None:
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "an int", float: "a number", bool: "a bool", str: "a string", list: "a list", dict: "an object"}[k] for k in kinds)


def _pattern(form: _Form, key: str, values: Mapping[Any, bool]) -> tuple[bool, ...]:
    items = form.get(key, list)
    bad = [v for v in items if isinstance(v, bool) or v not in values]
    if bad or not items:
        raise CheckpointError(f"config.json: {key} has entries {bad[:3] or items} outside {sorted(values, key=str)}")
    return tuple(values[v] for v in items)


class _TransformersForm(_Form):
    def build(self, num_mtp_layers: int | None) -> MiMoConfig:
        is_swa = _pattern(self, "layer_types", {"full_attention": False, "sliding_attention": True})
        is_moe = (
            _pattern(self, "mlp_layer_types", {"dense": False, "sparse": True})
            if self.raw.get("mlp_layer_types") is not None
            else (False,) + (True,) * (len(is_swa) - 1)
        )
        heads, kv_heads = self.positive("num_attention_heads"), self.positive("num_key_value_heads")
        head_dim, v_head_dim = self.positive("head_dim", 192), self.positive("v_head_dim", 128)
        rope = self.get("rope_parameters", dict, {})
        mtp_layers = num_mtp_layers if num_mtp_layers is not None else self.get("num_nextn_predict_layers", int, 0)
        window = self.positive("sliding_window") - 1 if any(is_swa) or mtp_layers else 0

        def shape(layer_type: str, kv: int, default_theta: float, sinks: bool) -> AttentionShape:
            params = rope.get(layer_type) or {}
            if params.get("rope_type", "default") != "default":
                raise CheckpointError(f"config.json: rope_parameters[{layer_type!r}].rope_type={params['rope_type']!r} is not supported")
            return AttentionShape(heads, kv, head_dim, v_head_dim, float(params.get("rope_theta", default_theta)),
                                  float(params.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)), sinks)

        return MiMoConfig(
            # transformers doubles the kv heads of SWA layers and gives only them sinks
            full=shape("full_attention", kv_heads, 5_000_000.0, False),
            swa=shape("sliding_attention", 2 * kv_heads, 10_000.0, True),
            sliding_window=window,
            rms_norm_eps=self.get("rms_norm_eps", float, 1e-5),
            num_mtp_layers=mtp_layers,
            **self.common(is_swa, is_moe),
        )


class _PublishedForm(_Form):
    def build(self, num_mtp_layers: int | None) -> MiMoConfig:
        is_swa = _pattern(self, "hybrid_layer_pattern", {0: False, 1: True})
        is_moe = _pattern(self, "moe_layer_freq", {0: False, 1: True})
        for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if any(is_moe) and self.raw.get(key, allowed) != allowed:
                raise CheckpointError(f"config.json: {key}={self.raw[key]!r} is not supported, expected {allowed!r}")
        if self.raw.get("n_shared_experts"):
            raise CheckpointError(f"config.json: n_shared_experts={self.raw['n_shared_experts']} is not supported (MiMo-V2-Flash has none)")
        factor = self.get("partial_rotary_factor", float, DEFAULT_PARTIAL_ROTARY_FACTOR)
        full = AttentionShape(
            self.positive("num_attention_heads"), self.positive("num_key_value_heads"), self.positive("head_dim"),
            self.positive("v_head_dim"), self.get("rope_theta", float), factor,
            self.get("add_full_attention_sink_bias", bool, False),
        )  # fmt: skip
        swa = AttentionShape(
            self.positive("swa_num_attention_heads", full.num_q_heads), self.positive("swa_num_key_value_heads", full.num_kv_heads),
            self.positive("swa_head_dim", full.head_dim), self.positive("swa_v_head_dim", full.v_head_dim),
            self.get("swa_rope_theta", float, full.rope_theta), factor, self.get("add_swa_attention_sink_bias", bool, False),
        )  # fmt: skip
        if (swa.head_dim, swa.v_head_dim) != (full.head_dim, full.v_head_dim):
            raise CheckpointError(
                f"config.json: swa_head_dim/swa_v_head_dim=({swa.head_dim}, {swa.v_head_dim}) differ from head_dim/v_head_dim="
                f"({full.head_dim}, {full.v_head_dim}); hal's engines take one pair of head dims"
            )
        mtp_layers = num_mtp_layers if num_mtp_layers is not None else self.get("num_nextn_predict_layers", int, 0)
        window = self.get("sliding_window_size", int, None)
        if (any(is_swa) or mtp_layers) and (window is None or window < 0):
            raise CheckpointError(f"config.json: sliding_window_size={window} must be an int >= 0 with SWA or MTP layers")
        return MiMoConfig(
            full=full,
            swa=swa,
            sliding_window=window or 0,
            rms_norm_eps=self.get("layernorm_epsilon", float, self.get("rms_norm_eps", float, 1e-5)),
            num_mtp_layers=mtp_layers,
            **self.common(is_swa, is_moe),
        )
