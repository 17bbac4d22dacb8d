"""The checks every attention call passes before anything touches the cache (one place, all backends)."""

from __future__ import annotations

import torch

from hal.errors import KVLayoutError, SpecError
from hal.metadata import AttentionMetadata
from hal.protocols import KVPool
from hal.spec import LayerSpec


def validate_attention_call(
    pool: KVPool,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    layer: LayerSpec,
    metadata: AttentionMetadata,
    sinks: torch.Tensor | None,
    save_kv_cache: bool = True,
    out: torch.Tensor | None = None,
) -> None:
    """Raise a typed error naming the first argument that does not fit ``layer``, ``pool`` and
    ``metadata`` (types, shapes, dtypes, devices, SWA routing, slot and page ids). ``k`` and ``v``
    may be None only when nothing is saved; ``out``, when given, must take the result (its
    contiguity is the caller's to check: strides are not part of a call's signature)."""
    if not isinstance(layer, LayerSpec):
        raise SpecError(f"layer must be a hal.LayerSpec, got {type(layer).__name__}")
    if not isinstance(metadata, AttentionMetadata):
        raise SpecError(f"metadata must be a hal.AttentionMetadata (see hal.build_metadata), got {type(metadata).__name__}")
    if not isinstance(save_kv_cache, bool):
        raise SpecError(f"layer {layer.layer_id}: save_kv_cache must be a bool, got {save_kv_cache!r}")
    required = ("q", "k", "v") if save_kv_cache else ("q",)
    for name, x in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
        if x is None and name in required:
            raise SpecError(
                f"layer {layer.layer_id}: {name} must be a torch.Tensor, got None"
                + ("" if name == "q" else " (k and v may be None only with save_kv_cache=False)")
            )
        if x is not None and not isinstance(x, torch.Tensor):
            raise SpecError(f"layer {layer.layer_id}: {name} must be a torch.Tensor, got {type(x).__name__}")
    t = metadata.num_tokens
    heads, dk, dv = pool.spec.layer_dims(layer.layer_id)
    if (heads, dk, dv) != (layer.num_kv_heads, layer.head_dim, layer.v_head_dim):
        raise KVLayoutError(
            f"layer {layer.layer_id}: LayerSpec has (kv_heads, head_dim, v_head_dim)="
            f"{(layer.num_kv_heads, layer.head_dim, layer.v_head_dim)} but the pool stores {(heads, dk, dv)}"
        )
    if tuple(q.shape) != (t, layer.num_q_heads, layer.head_dim):
        raise SpecError(
            f"layer {layer.layer_id}: q has shape {tuple(q.shape)}, expected "
            f"({t}, {layer.num_q_heads}, {layer.head_dim})"
        )
    for name, x, d in (("k", k, layer.head_dim), ("v", v, layer.v_head_dim)):
        if x is not None and tuple(x.shape) != (t, layer.num_kv_heads, d):
            raise SpecError(
                f"layer {layer.layer_id}: {name} has shape {tuple(x.shape)}, expected ({t}, {layer.num_kv_heads}, {d})"
            )
    for name, x in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):  # metadata's: the plan step
        if x is not None and x.device != pool.device:
            raise KVLayoutError(f"layer {layer.layer_id}: {name} is on {x.device}, the KV pool is on {pool.device}")
    if q.dtype != pool.spec.dtype:
        raise KVLayoutError(f"layer {layer.layer_id}: q has dtype {q.dtype}, the KV pool stores {pool.spec.dtype}")
    if layer.has_sinks != (sinks is not None):
        raise SpecError(
            f"layer {layer.layer_id}: has_sinks={layer.has_sinks} but sinks were "
            f"{'given' if sinks is not None else 'not given'}"
        )
    if sinks is not None and tuple(sinks.shape) != (layer.num_q_heads,):
        raise SpecError(
            f"layer {layer.layer_id}: sinks have shape {tuple(sinks.shape)}, expected ({layer.num_q_heads},)"
        )
    if pool.is_swa_layer(layer.layer_id):
        if layer.sliding_window is None:
            raise SpecError(
                f"layer {layer.layer_id} lives in the SWA sub-pool but LayerSpec.sliding_window is None"
            )
        if metadata.swa_block_table is None:
            raise SpecError(
                f"layer {layer.layer_id} is an SWA-pool layer but the metadata has no swa_block_table "
                "(build it with build_metadata(..., pool=pool))"
            )
    if out is not None:
        expected = (t, layer.num_q_heads, layer.v_head_dim)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected or out.dtype != q.dtype or out.device != q.device:
            got = f"a {out.dtype} tensor of shape {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise SpecError(f"layer {layer.layer_id}: out must be a {q.dtype} tensor of shape {expected} on {q.device}, got {got}")
