"""Tiny MiMo-V2-Flash checkpoints saved by transformers' ``MiMoV2FlashForCausalLM`` (the oracle of
the MiMo tests), and the MTP layers hal adds beside them (transformers writes none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hal.speculative.mimo import MiMoV2Flash
from hal.speculative.mimo_config import MiMoConfig
from hal.tools.testing import spread_sinks_and_router

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

BASE: dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
    v_head_dim=8, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    max_position_embeddings=512, routed_scaling_factor=1.5,
)


def make_checkpoint(directory: Path, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers model saved to ``directory``; returns the transformers model."""
    config = transformers.MiMoV2FlashConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.MiMoV2FlashForCausalLM(config).eval()
    spread_sinks_and_router(model)
    model.save_pretrained(directory, **({"max_shard_size": overrides.pop("_shard")} if "_shard" in overrides else {}))
    return model


def hf_load(directory: Path, **kwargs: Any) -> Any:
    return transformers.MiMoV2FlashForCausalLM.from_pretrained(directory, attn_implementation="eager", use_kernels=False, **kwargs).eval()


def add_mtp_layers(directory: Path, num_mtp_layers: int, seed: int = 1) -> None:
    """Store random MTP layers ``model.mtp.layers.{k}.*`` beside the target (transformers writes none)."""
    config = MiMoConfig.from_file(directory / "config.json", num_mtp_layers=num_mtp_layers)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {name: tuple(dest.shape) for name, dest, _, _ in MiMoV2Flash(config).checkpoint_tensors() if "mtp." in name}
    weights = safetensors_torch.load_file(directory / "model.safetensors")
    for name, shape in shapes.items():
        weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen) if name.endswith("norm.weight") else 0.2 * torch.randn(shape, generator=gen)
    safetensors_torch.save_file(weights, directory / "model.safetensors")
