"""Layers MiMo-V2-style models share: RMSNorm as MiMo-V2-Flash computes it, partial RoPE, the
dense SwiGLU MLP, and the engines' interface over a decoder stack with MTP layers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hal.speculative.contract import Attend, ModelSpec


class MTPDecoderStack(nn.Module):
    """``EngineModel`` for a model built as ``embed_tokens``, decoder ``layers``, a final ``norm`` and
    ``lm_head``, with MTP layers ``mtp`` that share its embedding and lm_head (both of hal's models);
    ``config.model_spec(dtype)`` describes it."""

    config: Any
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm
    lm_head: nn.Linear
    mtp: nn.ModuleList

    @property
    def spec(self) -> ModelSpec:
        """The engines' view; its dtype is the embedding's (whatever ``to(dtype)`` last made the weights)."""
        return self.config.model_spec(self.embed_tokens.weight.dtype)  # type: ignore[no-any-return]

    def target_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The final-normed hidden state: what lm_head reads and what the MTP layers take."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, attend)
        return self.norm(x)  # type: ignore[no-any-return]

    def mtp_hidden(
        self, step: int, input_ids: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """MTP layer ``step`` at position ``p`` reads ``(target_hidden[p], token[p + step + 1])``."""
        return self.mtp[step](self.embed_tokens(input_ids), target_hidden, positions, attend)  # type: ignore[no-any-return]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # type: ignore[no-any-return]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in float32 and cast back before the weight, as MiMo-V2-Flash (and transformers) do.
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class PartialRotary(nn.Module):
    """RoPE on the first ``rope_dim`` dims of each head (neox-style halves); the rest pass through."""

    cos: torch.Tensor  # [max_position, rope_dim / 2]
    sin: torch.Tensor

    def __init__(self, rope_dim: int, theta: float, max_position: int) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
        angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.rope_dim = rope_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [T, H, D]
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        half = self.rope_dim // 2
        x1, x2, rest = x[..., :half], x[..., half : self.rope_dim], x[..., self.rope_dim :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class MLP(nn.Module):
    """Dense SwiGLU feed-forward."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
