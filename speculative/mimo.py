"""MiMo-V2-Flash on hal: the published architecture, loaded from a checkpoint directory.

Hybrid full/sliding-window attention (each with its own kv heads, RoPE theta and, where the
config says, sinks), a value scale, partial RoPE, a dense first MLP and MoE layers (sigmoid
scores, a correction bias used only to choose experts, group-limited top-k, normalised weights,
routed scaling, no shared experts), and the MTP layers as the speculative worker's draft blocks.

Attention goes through an ``Attend`` callable (hal's ``AttentionKernel`` at inference, see
``hal.speculative.engine.KernelAttend``); everything else is plain device-neutral torch, the MoE
vectorised over experts (a backend MoE kernel is a later step). The interface is the one the
engines use with ``TinyMiMo``: ``target_hidden``, ``mtp_hidden``, ``logits`` and ``config``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from hal.distributed import SINGLE, TPGroup
from hal.errors import CheckpointError
from hal.spec import LayerSpec
from hal.speculative.checkpoint import Checkpoint
from hal.speculative.mimo_config import AttentionShape, MiMoConfig
from hal.speculative.contract import Attend
from hal.speculative.layers import MLP, MTPDecoderStack, RMSNorm

Progress = Callable[[int, int], None]


class Rotary(nn.Module):
    """Rotate-half RoPE on the first ``rotary_dim`` dims of each q/k head."""

    def __init__(self, shape: AttentionShape) -> None:
        super().__init__()
        dim = shape.rotary_dim
        self.inv_freq: torch.Tensor
        self.register_buffer(
            "inv_freq", 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), persistent=False
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x [T, H, D]
        freqs = positions.float()[:, None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        dim = emb.shape[-1]
        rot, rest = x[..., :dim], x[..., dim:]
        half = dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: MiMoConfig, shape: AttentionShape, spec: LayerSpec) -> None:
        super().__init__()
        h = config.hidden_size
        self.shape, self.spec, self.value_scale = shape, spec, config.attention_value_scale
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, shape.num_q_heads * shape.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * shape.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * shape.v_head_dim, bias=bias)
        self.o_proj = nn.Linear(shape.num_q_heads * shape.v_head_dim, h, bias=False)
        self.attention_sink_bias = nn.Parameter(torch.zeros(shape.num_q_heads)) if shape.has_sinks else None
        self.rotary = Rotary(shape)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        s, t = self.shape, x.shape[0]
        q = self.rotary(self.q_proj(x).view(t, s.num_q_heads, s.head_dim), positions)
        k = self.rotary(self.k_proj(x).view(t, s.num_kv_heads, s.head_dim), positions)
        v = self.v_proj(x).view(t, s.num_kv_heads, s.v_head_dim) * self.value_scale
        out = attend(self.spec, q, k, v, self.attention_sink_bias)
        return self.o_proj(out.reshape(t, -1))


class MoE(nn.Module):
    """Routed experts without shared ones; experts stored stacked ``[E, ...]``; tokens grouped by
    expert run as one grouped GEMM (or, where torch has none for the device and dtype, as a batched
    matmul over experts padded to the token count)."""

    def __init__(self, config: MiMoConfig) -> None:
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.config = config
        self.gate_weight = nn.Parameter(torch.zeros(e, h, dtype=torch.float32))  # the router stays fp32
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.gate_proj = nn.Parameter(torch.zeros(e, i, h))
        self.up_proj = nn.Parameter(torch.zeros(e, i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the chosen experts ``[T, k]`` and their weights ``[T, k]`` (float32)."""
        c = self.config
        scores = F.linear(x.float(), self.gate_weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias  # the bias picks experts, never weighs them
        per_group = c.n_routed_experts // c.n_group
        group_scores = choice.view(-1, c.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
        groups = group_scores.topk(c.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        experts = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * c.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        experts, weights = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        token_of = order // experts.shape[1]
        counts = torch.zeros(self.config.n_routed_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        # Group sizes stay on the device (no host read, so the layer also runs inside a graph capture).
        pairs = x[token_of]
        if _grouped_matmul_works(x, self.config.moe_intermediate_size):
            ends = torch.cumsum(counts, 0).to(torch.int32)
            act = F.silu(_grouped_mm(pairs, self.gate_proj.transpose(1, 2), ends)) * _grouped_mm(pairs, self.up_proj.transpose(1, 2), ends)
            rows = _grouped_mm(act, self.down_proj.transpose(1, 2), ends)
        else:  # padded per-expert batches; an expert takes each token at most once, so t rows suffice
            expert_of = flat[order]
            slot = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
            grouped = x.new_zeros((self.config.n_routed_experts, t, h))
            grouped[expert_of, slot] = pairs
            act = F.silu(torch.bmm(grouped, self.gate_proj.transpose(1, 2))) * torch.bmm(grouped, self.up_proj.transpose(1, 2))
            rows = torch.bmm(act, self.down_proj.transpose(1, 2))[expert_of, slot]
        rows = rows * weights.reshape(-1)[order, None].to(x.dtype)
        return x.new_zeros((t, h)).index_add_(0, token_of, rows)


def _grouped_mm(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``ends[e-1]:ends[e]`` of ``x`` times ``weights[e]``, one grouped GEMM."""
    return torch._grouped_mm(x, weights, offs=ends)


_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_matmul_works(x: torch.Tensor, *inner_dims: int) -> bool:
    """Whether torch's grouped GEMM runs for ``x``'s device type and dtype (tried once on a small
    case); its operands' rows (``x``'s and ``inner_dims`` wide) must be 16-byte aligned."""
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_MM_WORKS:
        try:
            probe = torch.ones((2, 16), dtype=x.dtype, device=x.device)
            out = _grouped_mm(probe, torch.ones((2, 16, 16), dtype=x.dtype, device=x.device),
                              torch.tensor([1, 2], dtype=torch.int32, device=x.device))
            _GROUPED_MM_WORKS[key] = out.shape == (2, 16)
        except (RuntimeError, NotImplementedError, AttributeError):
            _GROUPED_MM_WORKS[key] = False
    return _GROUPED_MM_WORKS[key] and all(d * x.element_size() % 16 == 0 for d in (x.shape[1], *inner_dims))


class DecoderLayer(nn.Module):
    def __init__(self, config: MiMoConfig, shape: AttentionShape, spec: LayerSpec, moe: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shape, spec)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = MoE(config) if moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        # Row-parallel o_proj and down projections: each rank's partial sums add up over the group.
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), positions, attend))
        out: torch.Tensor = self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x)))
        return x + out


class MTPLayer(nn.Module):
    """``eh_proj(cat(enorm(embed(token)), hnorm(hidden)))``, an SWA block with a dense MLP, ``final_layernorm``."""

    def __init__(self, config: MiMoConfig, spec: LayerSpec, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(config, config.swa, spec)
        self.pre_mlp_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, config.intermediate_size)
        self.final_layernorm = RMSNorm(h, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), positions, attend))
        x = x + self.tp.all_reduce(self.mlp(self.pre_mlp_layernorm(x)))
        return self.final_layernorm(x)


class MiMoV2Flash(MTPDecoderStack):
    """The model, with ``target_hidden`` / ``mtp_hidden`` / ``logits`` for hal's engines.

    With a ``tp`` group of N ranks this is one rank's shard (``config`` is then the rank's share,
    ``source_config`` the checkpoint's): attention q heads split N ways, kv heads split or, when
    there are fewer than N, replicated (sinks follow their q heads); q/k/v column-parallel and
    o_proj row-parallel with an all-reduce; dense MLPs column- then row-parallel; each routed
    expert tensor-parallel inside (its intermediate width split N ways, so routing, which reads
    the replicated router, picks the same experts on every rank and no tokens move between ranks;
    expert parallelism would need an all-to-all per MoE layer); the MTP layers likewise.
    Embedding and lm_head are replicated, so every rank computes the same logits and argmax
    without a gather.
    """

    def __init__(self, config: MiMoConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.source_config, self.tp = config, tp
        self.config = config = config.for_tensor_parallel(tp)
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.layers = nn.ModuleList(
            DecoderLayer(config, config.attention(i), config.target_layer_spec(i), config.layer_is_moe[i], tp)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(config, config.mtp_layer_spec(k), tp) for k in range(config.num_mtp_layers))
        self.tie_embeddings()

    def tie_embeddings(self) -> None:
        """With ``tie_word_embeddings`` the lm_head is the embedding (one parameter; ``to_empty`` unties it)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # -- loading ---------------------------------------------------------------------------
    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor, int | None, Shard | None]]:
        """``(published name, destination, expert, shard)``: where each checkpoint tensor goes (a
        slice of a stacked expert tensor when ``expert`` is set), and which part of it this rank
        holds (``shard``, None: all of it)."""
        yield "model.embed_tokens.weight", self.embed_tokens.weight, None, None
        yield "model.norm.weight", self.norm.weight, None, None
        if not self.config.tie_word_embeddings:
            yield "lm_head.weight", self.lm_head.weight, None, None
        shards = _Shards(self.source_config, self.tp)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            kind = "swa" if self.source_config.layer_is_swa[i] else "full"
            yield from _block_tensors(f"model.layers.{i}.", layer, {"post_attention_layernorm": layer.post_attention_layernorm},
                                      shards, kind)
        for k, mtp in enumerate(self.mtp):
            assert isinstance(mtp, MTPLayer)
            prefix = f"model.mtp.layers.{k}."
            for name, norm in (("enorm", mtp.enorm), ("hnorm", mtp.hnorm), ("final_layernorm", mtp.final_layernorm)):
                yield f"{prefix}{name}.weight", norm.weight, None, None
            yield f"{prefix}eh_proj.weight", mtp.eh_proj.weight, None, None
            yield from _block_tensors(prefix, mtp, {"pre_mlp_layernorm": mtp.pre_mlp_layernorm}, shards, "swa")

    @classmethod
    def from_pretrained(
        cls,
        directory: Path | str,
        *,
        dtype: torch.dtype = torch.float32,
        num_mtp_layers: int | None = None,
        progress: Progress | None = None,
        tp: TPGroup = SINGLE,
    ) -> MiMoV2Flash:
        """Build the model from ``directory`` (config.json + safetensors), streaming one tensor at a
        time into preallocated parameters. MTP layers: ``num_mtp_layers`` if given, else as many as
        the checkpoint stores (``model.mtp.layers.{k}``). With ``tp``, this rank's shard only."""
        directory = Path(directory)
        with Checkpoint(directory) as ckpt:
            stored_mtp = len(ckpt.layer_indices("model.mtp.layers."))
            config = MiMoConfig.from_file(directory / "config.json", num_mtp_layers=stored_mtp if num_mtp_layers is None else num_mtp_layers)
            with torch.device("meta"):
                model = cls(config, tp)
            model = model.to_empty(device="cpu").to(dtype)
            model.tie_embeddings()
            model.keep_router_in_float32()
            model.rotary_buffers_reset()
            targets = list(model.checkpoint_tensors())
            expected = {name for name, _, _, _ in targets}
            unused_mtp = {f"model.mtp.layers.{k}." for k in range(config.num_mtp_layers, stored_mtp)}
            unexpected = sorted(n for n in ckpt.names - expected if not any(n.startswith(p) for p in unused_mtp))
            if config.tie_word_embeddings and "lm_head.weight" in unexpected:
                raise CheckpointError(f"{directory} stores lm_head.weight, but config.json says tie_word_embeddings=true "
                                      "(the lm_head is the embedding)")
            if unexpected:
                raise CheckpointError(f"unexpected tensors in {directory}: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
            missing = sorted(expected - ckpt.names)
            if missing:
                raise CheckpointError(f"missing tensors in {directory}: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
            with torch.no_grad():
                for done, (name, dest, expert, shard) in enumerate(targets):
                    want = list(dest.shape[1:]) if expert is not None else list(dest.shape)
                    if shard is not None:
                        want[shard.dim] = shard.full
                    found = ckpt.shape(name)
                    if found != tuple(want):
                        raise CheckpointError(f"tensor {name!r}: shape mismatch, expected {tuple(want)}, found {found}")
                    value = ckpt.tensor(name)
                    if shard is not None:
                        value = value.narrow(shard.dim, shard.start, shard.length)
                    (dest[expert] if expert is not None else dest).copy_(value)
                    if progress is not None:
                        progress(done + 1, len(targets))
        return model.eval()

    def keep_router_in_float32(self) -> None:
        """The checkpoint stores MoE router weights and correction biases in float32; so does the model."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.gate_weight.data = module.gate_weight.data.float()
                module.e_score_correction_bias = module.e_score_correction_bias.float()

    def rotary_buffers_reset(self) -> None:
        """Recompute RoPE tables (``to_empty`` leaves non-persistent buffers uninitialised)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.rotary = Rotary(module.shape).to(self.lm_head.weight.device)


@attrs.frozen
class Shard:
    """The part of a checkpoint tensor one TP rank holds: ``length`` entries from ``start`` along ``dim`` (of ``full``)."""

    dim: int
    start: int
    length: int
    full: int


class _Shards:
    """Which slice of each sharded checkpoint tensor a rank loads (None everywhere for one rank)."""

    def __init__(self, config: MiMoConfig, tp: TPGroup) -> None:
        self.config, self.tp = config, tp

    def _heads(self, dim: int, first: int, count: int, total: int, width: int) -> Shard | None:
        return None if self.tp.size == 1 else Shard(dim, first * width, count * width, total * width)

    def q(self, kind: str, dim: int, width: int) -> Shard | None:
        heads = (self.config.full if kind == "full" else self.config.swa).num_q_heads
        first, count = self.tp.shard(heads, "num_attention_heads")
        return self._heads(dim, first, count, heads, width)

    def kv(self, kind: str, width: int) -> Shard | None:
        heads = (self.config.full if kind == "full" else self.config.swa).num_kv_heads
        first, count = self.config.kv_head_shard(kind, self.tp)
        return self._heads(0, first, count, heads, width)

    def width(self, total: int, dim: int) -> Shard | None:
        if self.tp.size == 1:
            return None
        first, count = self.tp.shard(total, "MLP intermediate size")
        return Shard(dim, first, count, total)


def _block_tensors(
    prefix: str, block: DecoderLayer | MTPLayer, norms: dict[str, RMSNorm], shards: _Shards, kind: str
) -> Iterator[tuple[str, torch.Tensor, int | None, Shard | None]]:
    """Attention, norms and MLP (dense or MoE) of one decoder or MTP block, by published name."""
    yield f"{prefix}input_layernorm.weight", block.input_layernorm.weight, None, None
    for name, norm in norms.items():
        yield f"{prefix}{name}.weight", norm.weight, None, None
    attn = block.self_attn
    shape = shards.config.full if kind == "full" else shards.config.swa
    yield f"{prefix}self_attn.q_proj.weight", attn.q_proj.weight, None, shards.q(kind, 0, shape.head_dim)
    yield f"{prefix}self_attn.k_proj.weight", attn.k_proj.weight, None, shards.kv(kind, shape.head_dim)
    yield f"{prefix}self_attn.v_proj.weight", attn.v_proj.weight, None, shards.kv(kind, shape.v_head_dim)
    yield f"{prefix}self_attn.o_proj.weight", attn.o_proj.weight, None, shards.q(kind, 1, shape.v_head_dim)
    if shards.config.attention_bias:
        assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
        yield f"{prefix}self_attn.q_proj.bias", attn.q_proj.bias, None, shards.q(kind, 0, shape.head_dim)
        yield f"{prefix}self_attn.k_proj.bias", attn.k_proj.bias, None, shards.kv(kind, shape.head_dim)
        yield f"{prefix}self_attn.v_proj.bias", attn.v_proj.bias, None, shards.kv(kind, shape.v_head_dim)
    if attn.attention_sink_bias is not None:
        yield f"{prefix}self_attn.attention_sink_bias", attn.attention_sink_bias, None, shards.q(kind, 0, 1)
    mlp = block.mlp
    if isinstance(mlp, MoE):
        yield f"{prefix}mlp.gate.weight", mlp.gate_weight, None, None
        yield f"{prefix}mlp.gate.e_score_correction_bias", mlp.e_score_correction_bias, None, None
        width = shards.config.moe_intermediate_size
        for e in range(mlp.config.n_routed_experts):
            for proj_name, stacked, dim in (("gate_proj", mlp.gate_proj, 0), ("up_proj", mlp.up_proj, 0), ("down_proj", mlp.down_proj, 1)):
                yield f"{prefix}mlp.experts.{e}.{proj_name}.weight", stacked, e, shards.width(width, dim)
    else:
        assert isinstance(mlp, MLP)
        width = shards.config.intermediate_size
        for proj_name, proj, dim in (("gate_proj", mlp.gate_proj, 0), ("up_proj", mlp.up_proj, 0), ("down_proj", mlp.down_proj, 1)):
            yield f"{prefix}mlp.{proj_name}.weight", proj.weight, None, shards.width(width, dim)
