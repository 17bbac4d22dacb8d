"""A tiny MiMo-V2-style model: hybrid SWA/full attention, sinks, GQA, qk != v dims, MTP blocks.

The structure follows MiMo-V2-Flash scaled down (see ``TinyConfig``): full attention at layer 0
and every layer ``i`` with ``(i + 1) % 6 == 0``, sliding-window attention elsewhere; SWA layers
carry a learnable per-head sink logit; full and SWA layers have different KV-head counts; the
query/key head dim (192) differs from the value head dim (128); RoPE rotates only the first
``rope_dim`` query/key dims. Each MTP block predicts one token further than the previous one
from ``eh_proj(cat(enorm(embed(token)), hnorm(target_hidden)))``, one SWA layer with sinks and a
final norm, and shares the target's embedding and lm_head.

The model does no attention itself: every layer calls an ``Attend`` callable with its q/k/v
(fp32, RoPE applied), so the same weights run through a hal ``AttentionKernel`` at inference
(``hal.speculative.engine.KernelAttend``) and through differentiable reference math in training.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from hal.errors import SpecError
from hal.spec import LayerSpec, positive_field
from hal.speculative.contract import Attend, ModelSpec
from hal.speculative.layers import MLP, MTPDecoderStack, PartialRotary, RMSNorm


@attrs.frozen
class TinyConfig:
    """Sizes of the tiny model. Defaults keep FIA-legal head dims (192/128) and a CPU-fast rest."""

    vocab_size: int = attrs.field(default=512, validator=positive_field)
    hidden_size: int = attrs.field(default=128, validator=positive_field)
    intermediate_size: int = attrs.field(default=256, validator=positive_field)
    # 18 layers: full attention at 0, 5, 11, 17. Deep enough that one MTP layer per draft step
    # is cheap next to a target forward, which is what makes MTP pay off.
    num_layers: int = attrs.field(default=18, validator=positive_field)
    num_q_heads: int = attrs.field(default=4, validator=positive_field)
    full_kv_heads: int = attrs.field(default=1, validator=positive_field)
    swa_kv_heads: int = attrs.field(default=2, validator=positive_field)
    qk_head_dim: int = attrs.field(default=192, validator=positive_field)
    v_head_dim: int = attrs.field(default=128, validator=positive_field)
    rope_dim: int = attrs.field(default=64, validator=positive_field)  # rotated dims of each q/k head
    sliding_window: int = attrs.field(default=16, validator=positive_field)  # W, hal.spec convention
    rope_theta_full: float = 5_000_000.0
    rope_theta_swa: float = 10_000.0
    max_position: int = attrs.field(default=4096, validator=positive_field)
    num_mtp_layers: int = attrs.field(default=3, validator=positive_field)
    rms_eps: float = 1e-6
    # Target attention outputs start small, so that (as in natural text) the next token depends
    # mostly on the recent tokens: a random target then has greedy continuations with recurring
    # phrases that MTP heads can learn in seconds, instead of near-chaotic ones.
    attention_output_scale: float = 0.25
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        for name in ("full_kv_heads", "swa_kv_heads"):
            if self.num_q_heads % getattr(self, name):
                raise SpecError(
                    f"TinyConfig.num_q_heads={self.num_q_heads} must be a multiple of {name}={getattr(self, name)}"
                )
        if self.rope_dim % 2 or self.rope_dim > self.qk_head_dim:
            raise SpecError(
                f"TinyConfig.rope_dim={self.rope_dim} must be even and <= qk_head_dim={self.qk_head_dim}"
            )

    def is_full_attention_layer(self, layer_id: int) -> bool:
        """MiMo-V2's hybrid pattern: full attention at layer 0 and every 6th layer."""
        return layer_id == 0 or (layer_id + 1) % 6 == 0

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_full_attention_layer(i))

    @property
    def swa_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.is_full_attention_layer(i))

    def target_layer_spec(self, layer_id: int) -> LayerSpec:
        full = self.is_full_attention_layer(layer_id)
        return LayerSpec(
            layer_id=layer_id,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.full_kv_heads if full else self.swa_kv_heads,
            head_dim=self.qk_head_dim,
            v_head_dim=self.v_head_dim,
            scaling=self.qk_head_dim**-0.5,
            sliding_window=None if full else self.sliding_window,
            has_sinks=not full,
        )

    def model_spec(self, dtype: torch.dtype = torch.float32) -> ModelSpec:
        """The engines' view of the model with weights in ``dtype``."""
        return ModelSpec(self.vocab_size, self.hidden_size, self.max_position,
                         tuple(self.target_layer_spec(i) for i in range(self.num_layers)),
                         tuple(self.mtp_layer_spec(k) for k in range(self.num_mtp_layers)), dtype=dtype)

    def mtp_layer_spec(self, step: int) -> LayerSpec:
        """MTP block ``step``'s attention: SWA head config with sinks, layer ``step`` of the MTP pool."""
        return LayerSpec(
            layer_id=step,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.swa_kv_heads,
            head_dim=self.qk_head_dim,
            v_head_dim=self.v_head_dim,
            scaling=self.qk_head_dim**-0.5,
            sliding_window=self.sliding_window,
            has_sinks=True,
        )


class Attention(nn.Module):
    def __init__(self, config: TinyConfig, spec: LayerSpec, rope_theta: float) -> None:
        super().__init__()
        self.spec = spec
        h = config.hidden_size
        self.q_proj = nn.Linear(h, spec.num_q_heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * spec.head_dim, bias=False)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * spec.v_head_dim, bias=False)
        self.o_proj = nn.Linear(spec.num_q_heads * spec.v_head_dim, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(spec.num_q_heads)) if spec.has_sinks else None
        self.rotary = PartialRotary(config.rope_dim, rope_theta, config.max_position)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        s = self.spec
        t = x.shape[0]
        q = self.rotary(self.q_proj(x).view(t, s.num_q_heads, s.head_dim), positions)
        k = self.rotary(self.k_proj(x).view(t, s.num_kv_heads, s.head_dim), positions)
        v = self.v_proj(x).view(t, s.num_kv_heads, s.v_head_dim)
        out = attend(s, q, k, v, self.sinks)
        return self.o_proj(out.reshape(t, s.num_q_heads * s.v_head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: TinyConfig, spec: LayerSpec) -> None:
        super().__init__()
        theta = config.rope_theta_swa if spec.is_swa else config.rope_theta_full
        self.input_norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.attn = Attention(config, spec, theta)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), positions, attend)
        return x + self.mlp(self.post_attention_norm(x))


class MTPBlock(nn.Module):
    """One MTP layer (MiMo-V2 ``MiMoV2ModelNextN``): enorm, hnorm, eh_proj, an SWA layer, final norm."""

    def __init__(self, config: TinyConfig, step: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_eps)
        self.hnorm = RMSNorm(h, config.rms_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(config, config.mtp_layer_spec(step))
        self.final_norm = RMSNorm(h, config.rms_eps)

    def forward(
        self, embedded: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(target_hidden)], dim=-1))
        return self.final_norm(self.layer(x, positions, attend))


class TinyMiMo(MTPDecoderStack):
    """Target model plus ``num_mtp_layers`` MTP blocks sharing its embedding and lm_head.

    ``target_hidden(...)`` returns the final-normed hidden state (what lm_head reads and what the MTP
    blocks receive, as SGLang's spec-v2 worker feeds them); ``mtp_hidden(step, ...)`` the final-normed
    output of MTP block ``step``; ``logits(hidden)`` applies the shared lm_head, so callers project
    only the rows they need.
    """

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, config.target_layer_spec(i)) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPBlock(config, k) for k in range(config.num_mtp_layers))
        self.reset_parameters(config.seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from ``seed``, the same on every machine (drawn on the CPU)."""
        gen = torch.Generator().manual_seed(seed)
        depth_scale = 1.0 / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                value = torch.ones(p.shape)
            elif name.endswith("sinks"):
                value = torch.randn(p.shape, generator=gen) * 0.5
            elif name == "embed_tokens.weight":
                value = torch.randn(p.shape, generator=gen)
            else:
                fan_in = p.shape[1]
                std = 1.0 / math.sqrt(fan_in)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= depth_scale
                if name.startswith("layers.") and name.endswith("o_proj.weight"):
                    std *= self.config.attention_output_scale
                value = torch.randn(p.shape, generator=gen) * std
            p.copy_(value.to(p.device))

    def mtp_parameters(self) -> list[nn.Parameter]:
        return list(self.mtp.parameters())

    # -- the published MiMo-V2-Flash checkpoint format ---------------------------------------
    def checkpoint_config(self) -> dict[str, Any]:
        """config.json in the form transformers writes: this model is MiMo-V2-Flash with dense MLPs
        everywhere, value scale 1 and no sinks on full layers (transformers' ``sliding_window`` is
        hal's W + 1; SWA layers have twice the full layers' kv heads, as transformers assumes)."""
        c = self.config
        if c.swa_kv_heads != 2 * c.full_kv_heads:
            raise SpecError(f"the checkpoint format needs swa_kv_heads = 2 * full_kv_heads, got {c.swa_kv_heads}, {c.full_kv_heads}")
        factor = c.rope_dim / c.qk_head_dim
        return {
            "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_q_heads, "num_key_value_heads": c.full_kv_heads, "head_dim": c.qk_head_dim,
            "v_head_dim": c.v_head_dim, "sliding_window": c.sliding_window + 1, "attention_value_scale": 1.0,
            "layer_types": ["full_attention" if c.is_full_attention_layer(i) else "sliding_attention" for i in range(c.num_layers)],
            "mlp_layer_types": ["dense"] * c.num_layers, "rms_norm_eps": c.rms_eps, "max_position_embeddings": c.max_position,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta_full, "partial_rotary_factor": factor},
                "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_theta_swa, "partial_rotary_factor": factor},
            },
            "tie_word_embeddings": False, "num_nextn_predict_layers": c.num_mtp_layers, "dtype": "float32",
        }  # fmt: skip

    def save_pretrained(self, directory: Path | str) -> Path:
        """Write this model as a MiMo-V2-Flash checkpoint (config.json + model.safetensors) to ``directory``."""
        from hal.speculative.checkpoint import save_checkpoint

        return save_checkpoint(directory, self.checkpoint_config(), self.checkpoint_tensors())

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The weights under the published tensor names (MTP blocks as ``model.mtp.layers.{k}``)."""

        def block(prefix: str, layer: DecoderLayer, post_norm: str) -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {
                f"{prefix}input_layernorm.weight": layer.input_norm.weight,
                f"{prefix}{post_norm}.weight": layer.post_attention_norm.weight,
            }
            attn, mlp = layer.attn, layer.mlp
            for name, proj in (("q_proj", attn.q_proj), ("k_proj", attn.k_proj), ("v_proj", attn.v_proj), ("o_proj", attn.o_proj)):
                out[f"{prefix}self_attn.{name}.weight"] = proj.weight
            if attn.sinks is not None:
                out[f"{prefix}self_attn.attention_sink_bias"] = attn.sinks
            for name, proj in (("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj), ("down_proj", mlp.down_proj)):
                out[f"{prefix}mlp.{name}.weight"] = proj.weight
            return out

        tensors: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight,
        }  # fmt: skip
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            tensors.update(block(f"model.layers.{i}.", layer, "post_attention_layernorm"))
        for k, mtp in enumerate(self.mtp):
            assert isinstance(mtp, MTPBlock)
            prefix = f"model.mtp.layers.{k}."
            tensors.update(block(prefix, mtp.layer, "pre_mlp_layernorm"))
            for name, norm in (("enorm", mtp.enorm), ("hnorm", mtp.hnorm), ("final_layernorm", mtp.final_norm)):
                tensors[f"{prefix}{name}.weight"] = norm.weight
            tensors[f"{prefix}eh_proj.weight"] = mtp.eh_proj.weight
        return {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
