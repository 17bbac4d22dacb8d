"""Layers MiMo-V2-style models share: RMSNorm as MiMo-V2-Flash computes it, partial RoPE, the
dense SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn


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
