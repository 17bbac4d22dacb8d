"""KV pool checks: layout, round trips, no aliasing, SWA routing, bad writes refused with nothing written."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from typing import Any

import attrs
import torch

from hal.allocator import KVAllocator
from hal.errors import CacheLocationError, KVLayoutError
from hal.protocols import Backend, KVPool
from hal.spec import KVPoolSpec, SWAPoolSpec
from hal.tools.testing import kv_rows, read_kv
from hal.tools.conformance.framework import Check, assert_only_rows_changed, expect_error, fail, randn, snapshot


@attrs.frozen
class _PoolConfig:
    label: str
    spec: KVPoolSpec


POOL_CONFIGS = (
    _PoolConfig(
        "fp32 d24/16 ps4",
        KVPoolSpec(num_layers=3, size=32, page_size=4, kv_heads=2, head_dim=24, v_head_dim=16, dtype=torch.float32),
    ),
    _PoolConfig(
        "bf16 hybrid d192/128 ps16",
        KVPoolSpec(
            num_layers=4,
            size=16 * 8,
            page_size=16,
            kv_heads=4,
            head_dim=192,
            v_head_dim=128,
            dtype=torch.bfloat16,
            swa=SWAPoolSpec(layer_ids=(1, 2), size=16 * 7, kv_heads=8, head_dim=192, v_head_dim=128),
        ),
    ),
)


def _filled_pool(backend: Backend, spec: KVPoolSpec, tag: str) -> tuple[KVPool, KVAllocator, torch.Tensor]:
    """A pool with every allocatable page handed out and every slot written with random K/V."""
    pool = backend.create_kv_pool(spec)
    alloc = KVAllocator(pool)
    pages = torch.tensor(alloc.alloc(alloc.num_free_pages), dtype=torch.int64)
    ps = spec.page_size
    slots = (pages[:, None] * ps + torch.arange(ps)).flatten()
    for layer in range(spec.num_layers):
        heads, dk, dv = spec.layer_dims(layer)
        k = randn((len(slots), heads, dk), spec.dtype, tag, "fill-k", layer)
        v = randn((len(slots), heads, dv), spec.dtype, tag, "fill-v", layer)
        pool.set_kv(layer, slots.to(pool.device), k.to(pool.device), v.to(pool.device))
    return pool, alloc, slots


def _check_pool_layout(backend: Backend, spec: KVPoolSpec) -> None:
    pool = backend.create_kv_pool(spec)
    ps = spec.page_size
    elem = torch.empty((), dtype=spec.dtype).element_size()
    expect_bytes = 0
    for layer in range(spec.num_layers):
        heads, dk, dv = spec.layer_dims(layer)
        expect_bytes += heads * (dk + dv) * elem
        swa = spec.is_swa_layer(layer)
        if pool.is_swa_layer(layer) != swa:
            fail(f"is_swa_layer({layer}) is {pool.is_swa_layer(layer)}, the spec says {swa}")
        pages = (spec.swa_num_pages if swa else spec.num_pages) + 1
        for name, buf, d in (("k_buffer", pool.k_buffer(layer), dk), ("v_buffer", pool.v_buffer(layer), dv)):
            if tuple(buf.shape) != (pages, ps, heads, d):
                fail(f"{name}({layer}) has shape {tuple(buf.shape)}, expected {(pages, ps, heads, d)}")
            if buf.dtype != spec.dtype:
                fail(f"{name}({layer}) has dtype {buf.dtype}, the spec says {spec.dtype}")
            if buf.device != pool.device:
                fail(f"{name}({layer}) lives on {buf.device}, the pool reports {pool.device}")
    if pool.bytes_per_token() != expect_bytes:
        fail(f"bytes_per_token() is {pool.bytes_per_token()}, expected sum(heads * (dk + dv) * {elem}) = {expect_bytes}")
    if pool.device.type != backend.device.type:
        fail(f"the pool lives on {pool.device}, the backend on {backend.device}")


def _check_pool_round_trip(backend: Backend, spec: KVPoolSpec) -> None:
    pool = backend.create_kv_pool(spec)
    alloc = KVAllocator(pool)
    pages = alloc.alloc(alloc.num_free_pages)
    ps = spec.page_size
    rng = random.Random(zlib.crc32(repr(spec).encode()))
    all_slots = [p * ps + o for p in pages for o in range(ps)]
    for layer in range(spec.num_layers):
        heads, dk, dv = spec.layer_dims(layer)
        for round_, loc_dtype in enumerate((torch.int64, torch.int32)):
            # Shuffled, page-crossing, includes the first and last slot of the pool.
            chosen = rng.sample(all_slots, max(2, len(all_slots) * 2 // 3))
            chosen = sorted(set(chosen) | {all_slots[0], all_slots[-1]}, key=lambda _: rng.random())
            loc = torch.tensor(chosen, dtype=loc_dtype)
            k = randn((len(chosen), heads, dk), spec.dtype, "rt-k", layer, round_)
            v = randn((len(chosen), heads, dv), spec.dtype, "rt-v", layer, round_)
            pool.set_kv(layer, loc.to(pool.device), k.to(pool.device), v.to(pool.device))
            got_k, got_v = read_kv(pool, layer, loc)
            if not torch.equal(got_k, k) or not torch.equal(got_v, v):
                which = "K" if not torch.equal(got_k, k) else "V"
                fail(f"layer {layer}: {which} read back from the slots just written ({loc_dtype}) differs")


def _check_pool_no_aliasing(backend: Backend, spec: KVPoolSpec) -> None:
    pool, _, slots = _filled_pool(backend, spec, "alias")
    before = snapshot(pool)
    last = spec.num_layers - 1
    ps = spec.page_size
    picks = [(0, int(slots[0])), (last, int(slots[-1])), (0, 0), (last, int(slots[ps - 1])), (last, int(slots[ps]))]
    picks += [(layer, int(slots[(7 * layer + 3) % len(slots)])) for layer in range(spec.num_layers)]
    for i, (layer, slot) in enumerate(picks):
        heads, dk, dv = spec.layer_dims(layer)
        loc = torch.tensor([slot], dtype=torch.int64)
        k = randn((1, heads, dk), spec.dtype, "alias-k", i) + 1
        v = randn((1, heads, dv), spec.dtype, "alias-v", i) - 1
        pool.set_kv(layer, loc.to(pool.device), k.to(pool.device), v.to(pool.device))
        row = int(kv_rows(pool, layer, loc)[0])
        before = assert_only_rows_changed(pool, before, {layer: {row}}, f"set_kv(layer {layer}, slot {slot})")
        got_k, got_v = before[layer][0][row], before[layer][1][row]
        if not torch.equal(got_k, k[0]) or not torch.equal(got_v, v[0]):
            fail(f"set_kv(layer {layer}, slot {slot}): the slot does not hold the written K/V")


def _check_pool_bad_input(backend: Backend, spec: KVPoolSpec) -> None:
    pool, _, slots = _filled_pool(backend, spec, "bad")
    dev = pool.device
    before = snapshot(pool)
    layer = spec.num_layers - 1
    heads, dk, dv = spec.layer_dims(layer)
    limit = (spec.num_pages + 1) * spec.page_size
    good = slots[:3].to(dev)

    def rows(n: int, h: int, d: int, dtype: torch.dtype = spec.dtype) -> torch.Tensor:
        return torch.ones((n, h, d), dtype=dtype, device=dev)

    other_dtype = torch.float16 if spec.dtype != torch.float16 else torch.float32
    cases: list[tuple[str, type[Exception], Callable[[], Any], tuple[str, ...]]] = [
        (
            f"loc {limit} (one past the pool)",
            CacheLocationError,
            lambda: pool.set_kv(layer, torch.tensor([limit], device=dev), rows(1, heads, dk), rows(1, heads, dv)),
            (str(limit),),
        ),
        (
            "negative loc -1",
            CacheLocationError,
            lambda: pool.set_kv(layer, torch.tensor([-1], device=dev), rows(1, heads, dk), rows(1, heads, dv)),
            ("-1",),
        ),
        (
            "one bad loc among good ones",
            CacheLocationError,
            lambda: pool.set_kv(
                layer, torch.cat([good, torch.tensor([limit + 5], device=dev)]), rows(4, heads, dk), rows(4, heads, dv)
            ),
            (str(limit + 5),),
        ),
        (
            f"k of dtype {other_dtype}",
            KVLayoutError,
            lambda: pool.set_kv(layer, good, rows(3, heads, dk, other_dtype), rows(3, heads, dv)),
            (str(other_dtype),),
        ),
        (
            f"v with head_dim {dk} instead of v_head_dim {dv}",
            KVLayoutError,
            lambda: pool.set_kv(layer, good, rows(3, heads, dk), rows(3, heads, dk)),
            (str((3, heads, dk)),),
        ),
        (
            f"k with {heads + 1} heads",
            KVLayoutError,
            lambda: pool.set_kv(layer, good, rows(3, heads + 1, dk), rows(3, heads, dv)),
            (str((3, heads + 1, dk)),),
        ),
        (
            "4 rows for 3 locations",
            KVLayoutError,
            lambda: pool.set_kv(layer, good, rows(4, heads, dk), rows(4, heads, dv)),
            (),
        ),
        ("float loc", KVLayoutError, lambda: pool.set_kv(layer, good.float(), rows(3, heads, dk), rows(3, heads, dv)), ()),
        ("2-D loc", KVLayoutError, lambda: pool.set_kv(layer, good.view(3, 1), rows(3, heads, dk), rows(3, heads, dv)), ()),
        (
            f"layer {spec.num_layers} (out of range)",
            KVLayoutError,
            lambda: pool.set_kv(spec.num_layers, good, rows(3, heads, dk), rows(3, heads, dv)),
            (str(spec.num_layers),),
        ),
    ]
    for what, expected, call, mentions in cases:
        expect_error(expected, call, f"set_kv with {what}", mentions)
        before = assert_only_rows_changed(pool, before, {}, f"the rejected set_kv with {what}")


def _check_pool_swa_mapping(backend: Backend, spec: KVPoolSpec) -> None:
    assert spec.swa is not None
    pool = backend.create_kv_pool(spec)
    alloc = KVAllocator(pool)
    assert alloc.swa is not None
    alloc.swa.alloc(2)  # hold two SWA pages so the full -> SWA mapping is not the identity
    pages = alloc.alloc(3)
    ps = spec.page_size
    table = torch.tensor([[0, *pages]], dtype=torch.int32, device=pool.device)
    mapped = pool.swa_block_table(table).view(-1).to("cpu").tolist()
    if mapped[0] != 0:
        fail(f"swa_block_table maps the padding page 0 to {mapped[0]}, expected 0")
    swa_pages = mapped[1:]
    if len(set(swa_pages)) != len(swa_pages) or not all(1 <= p <= spec.swa_num_pages for p in swa_pages):
        fail(f"live full pages {pages} map to SWA pages {swa_pages}: expected distinct pages in 1..{spec.swa_num_pages}")
    swa_layer, full_layer = spec.swa.layer_ids[0], spec.full_layer_ids[0]
    heads, dk, dv = spec.layer_dims(swa_layer)
    before = snapshot(pool)
    slot = pages[1] * ps + 3
    loc = torch.tensor([slot], device=pool.device)
    k = randn((1, heads, dk), spec.dtype, "swa-k") + 1
    v = randn((1, heads, dv), spec.dtype, "swa-v") - 1
    pool.set_kv(swa_layer, loc, k.to(pool.device), v.to(pool.device))
    expect_row = swa_pages[1] * ps + 3  # the test's own arithmetic, not the pool's
    before = assert_only_rows_changed(pool, before, {swa_layer: {expect_row}}, f"set_kv(SWA layer {swa_layer}, slot {slot})")
    if not torch.equal(before[swa_layer][0][expect_row], k[0]) or not torch.equal(before[swa_layer][1][expect_row], v[0]):
        fail(f"SWA layer {swa_layer}: full slot {slot} did not land at SWA row {expect_row} (page {swa_pages[1]})")
    alloc.free([pages[0]])
    freed = pool.swa_block_table(torch.tensor([[pages[0]]], dtype=torch.int32, device=pool.device))
    if int(freed.view(-1)[0]) != 0:
        fail(f"freed full page {pages[0]} still maps to SWA page {int(freed.view(-1)[0])}")
    dead = torch.tensor([pages[0] * ps], device=pool.device)
    expect_error(
        CacheLocationError,
        lambda: pool.set_kv(swa_layer, dead, k.to(pool.device), v.to(pool.device)),
        f"set_kv(SWA layer {swa_layer}) into unmapped full page {pages[0]}",
        (str(pages[0] * ps),),
    )
    assert_only_rows_changed(pool, before, {}, "the rejected write into an unmapped SWA page")
    fh, fdk, fdv = spec.layer_dims(full_layer)
    pool.set_kv(full_layer, dead, torch.ones((1, fh, fdk), dtype=spec.dtype, device=pool.device),
                torch.ones((1, fh, fdv), dtype=spec.dtype, device=pool.device))  # full layers need no SWA page


def pool_checks() -> list[Check]:
    checks = []
    for cfg in POOL_CONFIGS:
        spec = cfg.spec

        def bind(fn: Callable[[Backend, KVPoolSpec], None], s: KVPoolSpec = spec) -> Callable[[Backend], None]:
            return lambda backend: fn(backend, s)

        checks += [
            Check(f"kv pool layout [{cfg.label}]", ("kv pool: layout",), bind(_check_pool_layout)),
            Check(f"kv pool round trip [{cfg.label}]", ("kv pool: round trip",), bind(_check_pool_round_trip)),
            Check(f"kv pool no aliasing [{cfg.label}]", ("kv pool: no aliasing",), bind(_check_pool_no_aliasing)),
            Check(f"kv pool bad input [{cfg.label}]", ("kv pool: bad input", "errors: typed, nothing written"),
                  bind(_check_pool_bad_input)),
        ]
        if spec.swa is not None:
            checks.append(Check(f"kv pool SWA mapping [{cfg.label}]", ("kv pool: SWA mapping",), bind(_check_pool_swa_mapping)))
    return checks
