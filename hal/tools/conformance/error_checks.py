"""Error checks: bad attention inputs raise the documented ``hal.errors`` types and leave the cache unchanged."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch

from hal.allocator import KVAllocator, RequestPageTable
from hal.errors import CacheLocationError, KVLayoutError, SpecError
from hal.metadata import build_metadata
from hal.protocols import Backend
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec
from hal.tools.conformance.framework import Check, assert_only_rows_changed, expect_error, randn, snapshot
from hal.tools.conformance.graph_checks import LoopConfig, loop_configs


def _check_attention_errors(backend: Backend, cfg: LoopConfig) -> None:
    full, swa = cfg.target_layers()
    spec = KVPoolSpec(
        num_layers=2,
        size=cfg.page_size * 4,
        page_size=cfg.page_size,
        kv_heads=cfg.full_kv_heads,
        head_dim=cfg.head_dim,
        v_head_dim=cfg.v_head_dim,
        dtype=cfg.dtype,
        swa=SWAPoolSpec((1,), cfg.page_size * 4, cfg.swa_kv_heads, cfg.head_dim, cfg.v_head_dim),
    )
    pool = backend.create_kv_pool(spec)
    attn = backend.create_attention(pool)
    table = RequestPageTable(KVAllocator(pool))
    dev, dt, ps = pool.device, cfg.dtype, cfg.page_size
    n = ps + 3
    table.reserve(0, n + 1)
    sinks = torch.zeros(cfg.q_heads, device=dev)

    def tensors(lay: LayerSpec, rows: int, tag: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            randn((rows, lay.num_q_heads, lay.head_dim), dt, tag, "q").to(dev),
            randn((rows, lay.num_kv_heads, lay.head_dim), dt, tag, "k").to(dev),
            randn((rows, lay.num_kv_heads, lay.v_head_dim), dt, tag, "v").to(dev),
        )

    prefill = build_metadata(ForwardMode.EXTEND, kv_lens=[n], q_lens=[n], page_table=table.table([0]),
                             out_cache_loc=table.slots(0, range(n)), pool=pool)
    for lay in (full, swa):  # a valid forward first: proves the configuration is supported
        q, k, v = tensors(lay, n, f"prefill{lay.layer_id}")
        attn.forward(q, k, v, lay, attn.plan(prefill), sinks=sinks if lay.has_sinks else None)
    decode = build_metadata(ForwardMode.DECODE, kv_lens=[n + 1], q_lens=[1], page_table=table.table([0]),
                            out_cache_loc=table.slots(0, [n]), pool=pool)
    no_swa_table = build_metadata(ForwardMode.DECODE, kv_lens=[n + 1], q_lens=[1], page_table=table.table([0]),
                                  out_cache_loc=table.slots(0, [n]), page_size=ps, device=dev)
    other_ps = 2 * ps
    wrong_ps = build_metadata(ForwardMode.DECODE, kv_lens=[n + 1], q_lens=[1], page_table=[[1]],
                              out_cache_loc=table.slots(0, [n]), page_size=other_ps, device=dev)
    limit = (spec.num_pages + 1) * ps
    # Built without the pool (which would refuse it): the kernel's own validation must.
    bad_loc = build_metadata(ForwardMode.DECODE, kv_lens=[n + 1], q_lens=[1], page_table=table.table([0]),
                             out_cache_loc=[limit + 1], page_size=ps, device=dev)
    q, k, v = tensors(full, 1, "decode")
    sq, sk, sv = tensors(swa, 1, "decode-swa")
    other_dtype = torch.float16 if dt != torch.float16 else torch.bfloat16
    wrong_dims = attrs.evolve(full, v_head_dim=cfg.v_head_dim + 8)
    cases: list[tuple[str, type[Exception], Callable[[], Any], tuple[str, ...]]] = [
        ("q with one head too many", SpecError,
         lambda: attn.forward(torch.cat([q, q[:, :1]], 1), k, v, full, attn.plan(decode)), (str((1, cfg.q_heads + 1, cfg.head_dim)),)),
        ("v with head_dim instead of v_head_dim", SpecError,
         lambda: attn.forward(q, k, k, full, attn.plan(decode)), (str((1, cfg.full_kv_heads, cfg.head_dim)),)),
        ("two rows for one token", SpecError,
         lambda: attn.forward(torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]), full, attn.plan(decode)), ()),
        (f"q of dtype {other_dtype}", KVLayoutError,
         lambda: attn.forward(q.to(other_dtype), k, v, full, attn.plan(decode)), (str(other_dtype),)),
        ("a LayerSpec whose v_head_dim the pool does not store", KVLayoutError,
         lambda: attn.forward(q, k, v, wrong_dims, attn.plan(decode)), (str(cfg.v_head_dim + 8),)),
        ("a sinks layer called without sinks", SpecError, lambda: attn.forward(sq, sk, sv, swa, attn.plan(decode)), ()),
        ("sinks on a layer without them", SpecError, lambda: attn.forward(q, k, v, full, attn.plan(decode), sinks=sinks), ()),
        ("sinks of the wrong shape", SpecError,
         lambda: attn.forward(sq, sk, sv, swa, attn.plan(decode), sinks=sinks[:-1]), (str((cfg.q_heads - 1,)),)),
        ("an SWA-pool layer with metadata lacking swa_block_table", SpecError,
         lambda: attn.forward(sq, sk, sv, swa, attn.plan(no_swa_table), sinks=sinks), ()),
        (f"metadata with page_size {other_ps}", SpecError,
         lambda: attn.forward(q, k, v, full, attn.plan(wrong_ps)), (str(other_ps),)),
        (f"out_cache_loc {limit + 1} outside the pool", CacheLocationError,
         lambda: attn.forward(q, k, v, full, attn.plan(bad_loc)), (str(limit + 1),)),
    ]
    before = snapshot(pool)
    for what, expected, call, mentions in cases:
        expect_error(expected, call, f"attention forward with {what}", mentions)
        before = assert_only_rows_changed(pool, before, {}, f"the rejected forward with {what}")


def error_checks() -> list[Check]:
    checks = []
    for cfg in loop_configs(quick=True):
        if cfg.draft_steps:
            continue
        shape = cfg.label.split("[", 1)[1].rstrip("]")
        checks.append(
            Check(
                f"attention bad input [{shape}]",
                ("errors: attention bad input", "errors: typed, nothing written"),
                functools.partial(_check_attention_errors, cfg=cfg),
            )
        )
    return checks
