"""The decoder a user would write without hal: one contiguous KV cache per layer and torch's SDPA.

``hal bench`` measures hal's decoders against it on the same weights. It shares nothing with hal's
attention path (no pool, no metadata, no kernel): each layer keeps ``[B, kv_heads, max_len, dim]``
K and V tensors, writes the new rows by slicing, and calls
``torch.nn.functional.scaled_dot_product_attention`` over the cached prefix, on sliding-window
layers over the last ``W + 1`` keys only. A learnable sink is one extra key column whose K and V
are zero and whose additive mask entry is the sink logit, which is exactly the sink's softmax term.
Requests of one batch share their prompt length (no padding), as in ``hal bench``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch.nn.functional import scaled_dot_product_attention

from hal.errors import SpecError
from hal.spec import LayerSpec
from hal.speculative import GenerationResult
from hal.speculative.contract import EngineModel


class _ContiguousCache:
    """Per-layer ``[B, H, max_len (+1 sink column), D]`` K/V and the batch's common length."""

    def __init__(self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        self.batch, self.max_len, self.device, self.dtype = batch, max_len, device, dtype
        self.length = 0  # tokens cached before the current forward
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(
        self, layer: LayerSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        b, n = self.batch, q.shape[0] // self.batch
        lid, sink_cols = layer.layer_id, int(sinks is not None)
        if lid not in self.k:  # column 0 is the sink's zero key/value when the layer has sinks
            shape = (b, layer.num_kv_heads, sink_cols + self.max_len)
            self.k[lid] = torch.zeros((*shape, layer.head_dim), dtype=self.dtype, device=self.device)
            self.v[lid] = torch.zeros((*shape, layer.v_head_dim), dtype=self.dtype, device=self.device)
        kc, vc = self.k[lid], self.v[lid]
        start, end = self.length, self.length + n
        kc[:, :, sink_cols + start : sink_cols + end] = k.view(b, n, -1, layer.head_dim).transpose(1, 2)
        vc[:, :, sink_cols + start : sink_cols + end] = v.view(b, n, -1, layer.v_head_dim).transpose(1, 2)
        first = 0 if layer.sliding_window is None else max(0, start - layer.sliding_window)  # oldest key any row sees
        keys = kc[:, :, sink_cols + first : sink_cols + end]
        values = vc[:, :, sink_cols + first : sink_cols + end]
        qb = q.view(b, n, -1, layer.head_dim).transpose(1, 2)
        mask = None
        if n > 1 or sinks is not None:
            mask = self._mask(layer, sinks, first, start, end, q.dtype)
        if sinks is not None:
            keys = torch.cat([kc[:, :, :1], keys], 2)
            values = torch.cat([vc[:, :, :1], values], 2)
        out = scaled_dot_product_attention(qb, keys, values, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * n, layer.num_q_heads, layer.v_head_dim)

    def _mask(
        self, layer: LayerSpec, sinks: torch.Tensor | None, first: int, start: int, end: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Additive ``[1, Hq, n, (1 +) keys]`` mask: causal and window rules, the sink logit in column 0."""
        pos = torch.arange(start, end, device=self.device)[:, None]
        key = torch.arange(first, end, device=self.device)[None, :]
        allowed = key <= pos
        if layer.sliding_window is not None:
            allowed &= key >= pos - layer.sliding_window
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(~allowed, float("-inf"))
        mask = mask[None, None].expand(1, layer.num_q_heads, *allowed.shape)
        if sinks is None:
            return mask
        sink_col = sinks.to(dtype).view(1, -1, 1, 1).expand(1, layer.num_q_heads, end - start, 1)
        return torch.cat([sink_col, mask], -1)


class PlainDecoder:
    """Greedy decoding of ``model``'s target with a contiguous per-layer KV cache and SDPA, on ``device``."""

    def __init__(self, model: EngineModel, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.dtype = dtype

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> GenerationResult:
        """Greedy continuation of equal-length ``prompts``, ``max_new_tokens`` each."""
        lengths = {len(p) for p in prompts}
        if len(lengths) != 1 or 0 in lengths:
            raise SpecError(f"PlainDecoder: prompts must be non-empty and of equal length, got lengths {sorted(lengths)}")
        if max_new_tokens < 1:
            raise SpecError(f"PlainDecoder: max_new_tokens must be >= 1, got {max_new_tokens}")
        batch, prompt_len = len(prompts), lengths.pop()
        cache = _ContiguousCache(batch, prompt_len + max_new_tokens, self.device, self.dtype)
        start = time.perf_counter()
        with torch.no_grad():
            ids = torch.tensor(prompts, dtype=torch.int64, device=self.device)
            positions = torch.arange(prompt_len, device=self.device).repeat(batch)
            hidden = self.model.target_hidden(ids.view(-1), positions, cache.attend)
            token = self.model.logits(hidden.view(batch, prompt_len, -1)[:, -1]).argmax(-1)
            out = [token]
            cache.length = prompt_len
            for _ in range(max_new_tokens - 1):
                positions = torch.full((batch,), cache.length, dtype=torch.int64, device=self.device)
                token = self.model.logits(self.model.target_hidden(token, positions, cache.attend)).argmax(-1)
                out.append(token)
                cache.length += 1
            tokens = torch.stack(out, 1).tolist()
        seconds = time.perf_counter() - start
        return GenerationResult(tuple(tuple(t) for t in tokens), seconds, max_new_tokens)
