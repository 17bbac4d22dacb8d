"""The conformance suite: one set of checks every backend must pass, against the CPU reference.

Run it on any registered backend, third-party ones included::

    hal conformance --device npu --emulate          # the CLI
    pytest --hal-device=npu --hal-emulate           # the pytest plugin (hal.pytest_plugin)
    hal.conformance.run_suite(hal.get_backend("mydev"), hal.conformance.build_suite())

What it checks (each check lists the features it exercises; the report counts per feature):

- KV pool layout: buffer shapes and dtypes, round trips, no aliasing across layers, slots and
  K vs V, SWA sub-pool routing through the page mapping, bad writes raise a typed error and
  change nothing.
- Attention: every forward mode crossed with sliding window, sinks, hybrid SWA pools, GQA,
  qk_head_dim != v_head_dim, page sizes 16/64/128 and float32/float16/bfloat16, each compared
  with ``backends.cpu.paged_attention`` on identical pool contents (``hal.testing``). Outputs
  must agree within ``hal.testing.TOLERANCE[dtype]`` (about two ulps of the output dtype at
  magnitude 1: fp32 2e-5, fp16 2e-3, bf16 1.6e-2, absolute and relative); cached K/V must be
  bit-identical and rows of no token must stay untouched.
- Graphs, through ``hal.GraphRunner`` on the backend's own ``Graph``: a DECODE loop and a
  synthetic MTP loop (TARGET_VERIFY over S + 1 tokens, then S DRAFT_EXTEND_V2 steps, each fed
  by the previous step's output) with kv lengths growing and the batch changing between
  replays, padded batches and the eager fallback above the largest captured size. At every
  step the replayed result must equal the backend's eager result, which must equal the
  reference; padded rows may write the padding page only.
- Errors: bad attention inputs and graph misuse raise the documented ``hal.errors`` types
  and leave the cache unchanged.

A check whose configuration the backend declines with ``hal.errors.UnsupportedConfigError``
is reported as "unsupported", not "failed".
"""

from __future__ import annotations

import argparse
import enum
import functools
import random
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import attrs
import torch

from hal.allocator import KVAllocator, RequestPageTable
from hal.errors import (
    CacheLocationError,
    GraphError,
    KVLayoutError,
    SpecError,
    UnsupportedConfigError,
)
from hal.graph_runner import GraphRunner
from hal.metadata import AttentionMetadata, build_metadata
from hal.protocols import AttentionKernel, Backend, KVPool
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec
from hal.testing import TOLERANCE, AttentionCase, kv_rows, read_kv, run_attention_case


class Status(enum.Enum):
    """Outcome of one check."""

    PASSED = "passed"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"


class ConformanceFailure(AssertionError):
    """A backend result that breaks the contract (the check's message says how)."""


@attrs.frozen
class Check:
    """One conformance check: ``fn(backend)`` returns on success, raises otherwise."""

    name: str
    features: tuple[str, ...]
    fn: Callable[[Backend], None] = attrs.field(repr=False)


@attrs.frozen
class CheckResult:
    """A check's status, why (failure or unsupported reason) and how long it took."""

    check: Check
    status: Status
    detail: str = ""
    seconds: float = 0.0


@attrs.frozen
class FeatureRow:
    """Counts of one feature in the report table."""

    feature: str
    passed: int
    failed: int
    unsupported: int


def run_check(backend: Backend, check: Check) -> CheckResult:
    """Run one check; UnsupportedConfigError means unsupported, any other exception failed."""
    start = time.perf_counter()
    try:
        check.fn(backend)
    except UnsupportedConfigError as exc:
        return CheckResult(check, Status.UNSUPPORTED, str(exc), time.perf_counter() - start)
    except ConformanceFailure as exc:
        return CheckResult(check, Status.FAILED, str(exc), time.perf_counter() - start)
    except Exception as exc:  # a crash is a failure too, reported with its type
        return CheckResult(check, Status.FAILED, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
    return CheckResult(check, Status.PASSED, "", time.perf_counter() - start)


def run_suite(
    backend: Backend,
    checks: Sequence[Check],
    *,
    progress: Callable[[int, int, CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run ``checks`` in order on ``backend``; ``progress(i, n, result)`` after each."""
    results = []
    for i, check in enumerate(checks):
        result = run_check(backend, check)
        results.append(result)
        if progress is not None:
            progress(i + 1, len(checks), result)
    return results


def summarize(results: Sequence[CheckResult]) -> list[FeatureRow]:
    """Counts per feature, in the order features first appear; a check counts in each of its features."""
    counts: dict[str, dict[Status, int]] = {}
    for result in results:
        for feature in result.check.features:
            row = counts.setdefault(feature, {s: 0 for s in Status})
            row[result.status] += 1
    return [FeatureRow(f, c[Status.PASSED], c[Status.FAILED], c[Status.UNSUPPORTED]) for f, c in counts.items()]


def format_table(results: Sequence[CheckResult]) -> str:
    """A markdown table: one row per feature, then the total over distinct checks."""
    rows = [(r.feature, str(r.passed), str(r.failed), str(r.unsupported)) for r in summarize(results)]
    total = {s: sum(1 for r in results if r.status is s) for s in Status}
    rows.append(
        (
            f"**total ({len(results)} checks)**",
            str(total[Status.PASSED]),
            str(total[Status.FAILED]),
            str(total[Status.UNSUPPORTED]),
        )
    )
    header = ("feature", "passed", "failed", "unsupported")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


# ---------------------------------------------------------------------------------------------
# shared helpers


def _fail(message: str) -> None:
    raise ConformanceFailure(message)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _seeded(*tag: object) -> torch.Generator:
    """A generator whose stream depends only on ``tag`` (identical in every run and world)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(tag).encode()))


def _randn(shape: Sequence[int], dtype: torch.dtype, *tag: object) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=_seeded(*tag)).to(dtype)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A float32 host copy (never a view: graph outputs are overwritten by the next replay)."""
    return t.detach().to("cpu", torch.float32, copy=True)


def _snapshot(pool: KVPool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Host copies of every layer's K and V rows."""
    return [read_kv(pool, layer) for layer in range(pool.spec.num_layers)]


def _changed_rows(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    diff = (before != after).flatten(1).any(1) if before.numel() else torch.zeros(0, dtype=torch.bool)
    return set(torch.nonzero(diff).flatten().tolist())


def _assert_only_rows_changed(
    pool: KVPool,
    before: list[tuple[torch.Tensor, torch.Tensor]],
    allowed: Mapping[int, set[int]],
    what: str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fail if any layer's K or V changed outside ``allowed[layer]`` rows; returns the new snapshot."""
    after = _snapshot(pool)
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, after)):
        for name, a, b in (("K", k0, k1), ("V", v0, v1)):
            stray = sorted(_changed_rows(a, b) - allowed.get(layer, set()))
            if stray:
                _fail(f"{what} changed layer {layer} {name} rows {stray[:8]} it must not touch")
    return after


def _assert_close(got: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOLERANCE[dtype]
    got_c, exp_c = got.detach().to("cpu").float(), expect.detach().to("cpu").float()
    if got_c.shape != exp_c.shape:
        _fail(f"{what}: shape {tuple(got_c.shape)}, expected {tuple(exp_c.shape)}")
    if not torch.allclose(got_c, exp_c, atol=atol, rtol=rtol):
        err = float((got_c - exp_c).abs().max())
        _fail(f"{what}: max |err| {err:.3g} exceeds atol {atol} + rtol {rtol} ({_dtype_name(dtype)})")


def _expect_error(
    expected: type[Exception], call: Callable[[], Any], what: str, mentions: Iterable[str] = ()
) -> None:
    try:
        call()
    except expected as exc:
        message = str(exc)
        missing = [m for m in mentions if m not in message]
        if missing:
            _fail(f"{what}: {type(exc).__name__} message {message!r} does not name {missing}")
        return
    except UnsupportedConfigError:
        raise
    except Exception as exc:
        _fail(f"{what}: raised {type(exc).__name__} ({exc}), expected hal.errors.{expected.__name__}")
    _fail(f"{what}: did not raise, expected hal.errors.{expected.__name__}")


# ---------------------------------------------------------------------------------------------
# KV pool checks


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
        k = _randn((len(slots), heads, dk), spec.dtype, tag, "fill-k", layer)
        v = _randn((len(slots), heads, dv), spec.dtype, tag, "fill-v", layer)
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
            _fail(f"is_swa_layer({layer}) is {pool.is_swa_layer(layer)}, the spec says {swa}")
        pages = (spec.swa_num_pages if swa else spec.num_pages) + 1
        for name, buf, d in (("k_buffer", pool.k_buffer(layer), dk), ("v_buffer", pool.v_buffer(layer), dv)):
            if tuple(buf.shape) != (pages, ps, heads, d):
                _fail(f"{name}({layer}) has shape {tuple(buf.shape)}, expected {(pages, ps, heads, d)}")
            if buf.dtype != spec.dtype:
                _fail(f"{name}({layer}) has dtype {buf.dtype}, the spec says {spec.dtype}")
            if buf.device != pool.device:
                _fail(f"{name}({layer}) lives on {buf.device}, the pool reports {pool.device}")
    if pool.bytes_per_token() != expect_bytes:
        _fail(f"bytes_per_token() is {pool.bytes_per_token()}, expected sum(heads * (dk + dv) * {elem}) = {expect_bytes}")
    if pool.device.type != backend.device.type:
        _fail(f"the pool lives on {pool.device}, the backend on {backend.device}")


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
            k = _randn((len(chosen), heads, dk), spec.dtype, "rt-k", layer, round_)
            v = _randn((len(chosen), heads, dv), spec.dtype, "rt-v", layer, round_)
            pool.set_kv(layer, loc.to(pool.device), k.to(pool.device), v.to(pool.device))
            got_k, got_v = read_kv(pool, layer, loc)
            if not torch.equal(got_k, k) or not torch.equal(got_v, v):
                which = "K" if not torch.equal(got_k, k) else "V"
                _fail(f"layer {layer}: {which} read back from the slots just written ({loc_dtype}) differs")


def _check_pool_no_aliasing(backend: Backend, spec: KVPoolSpec) -> None:
    pool, _, slots = _filled_pool(backend, spec, "alias")
    before = _snapshot(pool)
    last = spec.num_layers - 1
    ps = spec.page_size
    picks = [(0, int(slots[0])), (last, int(slots[-1])), (0, 0), (last, int(slots[ps - 1])), (last, int(slots[ps]))]
    picks += [(layer, int(slots[(7 * layer + 3) % len(slots)])) for layer in range(spec.num_layers)]
    for i, (layer, slot) in enumerate(picks):
        heads, dk, dv = spec.layer_dims(layer)
        loc = torch.tensor([slot], dtype=torch.int64)
        k = _randn((1, heads, dk), spec.dtype, "alias-k", i) + 1
        v = _randn((1, heads, dv), spec.dtype, "alias-v", i) - 1
        pool.set_kv(layer, loc.to(pool.device), k.to(pool.device), v.to(pool.device))
        row = int(kv_rows(pool, layer, loc)[0])
        before = _assert_only_rows_changed(pool, before, {layer: {row}}, f"set_kv(layer {layer}, slot {slot})")
        got_k, got_v = before[layer][0][row], before[layer][1][row]
        if not torch.equal(got_k, k[0]) or not torch.equal(got_v, v[0]):
            _fail(f"set_kv(layer {layer}, slot {slot}): the slot does not hold the written K/V")


def _check_pool_bad_input(backend: Backend, spec: KVPoolSpec) -> None:
    pool, _, slots = _filled_pool(backend, spec, "bad")
    dev = pool.device
    before = _snapshot(pool)
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
        _expect_error(expected, call, f"set_kv with {what}", mentions)
        before = _assert_only_rows_changed(pool, before, {}, f"the rejected set_kv with {what}")


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
        _fail(f"swa_block_table maps the padding page 0 to {mapped[0]}, expected 0")
    swa_pages = mapped[1:]
    if len(set(swa_pages)) != len(swa_pages) or not all(1 <= p <= spec.swa_num_pages for p in swa_pages):
        _fail(f"live full pages {pages} map to SWA pages {swa_pages}: expected distinct pages in 1..{spec.swa_num_pages}")
    swa_layer, full_layer = spec.swa.layer_ids[0], spec.full_layer_ids[0]
    heads, dk, dv = spec.layer_dims(swa_layer)
    before = _snapshot(pool)
    slot = pages[1] * ps + 3
    loc = torch.tensor([slot], device=pool.device)
    k = _randn((1, heads, dk), spec.dtype, "swa-k") + 1
    v = _randn((1, heads, dv), spec.dtype, "swa-v") - 1
    pool.set_kv(swa_layer, loc, k.to(pool.device), v.to(pool.device))
    expect_row = swa_pages[1] * ps + 3  # the test's own arithmetic, not the pool's
    before = _assert_only_rows_changed(pool, before, {swa_layer: {expect_row}}, f"set_kv(SWA layer {swa_layer}, slot {slot})")
    if not torch.equal(before[swa_layer][0][expect_row], k[0]) or not torch.equal(before[swa_layer][1][expect_row], v[0]):
        _fail(f"SWA layer {swa_layer}: full slot {slot} did not land at SWA row {expect_row} (page {swa_pages[1]})")
    alloc.free([pages[0]])
    freed = pool.swa_block_table(torch.tensor([[pages[0]]], dtype=torch.int32, device=pool.device))
    if int(freed.view(-1)[0]) != 0:
        _fail(f"freed full page {pages[0]} still maps to SWA page {int(freed.view(-1)[0])}")
    dead = torch.tensor([pages[0] * ps], device=pool.device)
    _expect_error(
        CacheLocationError,
        lambda: pool.set_kv(swa_layer, dead, k.to(pool.device), v.to(pool.device)),
        f"set_kv(SWA layer {swa_layer}) into unmapped full page {pages[0]}",
        (str(pages[0] * ps),),
    )
    _assert_only_rows_changed(pool, before, {}, "the rejected write into an unmapped SWA page")
    fh, fdk, fdv = spec.layer_dims(full_layer)
    pool.set_kv(full_layer, dead, torch.ones((1, fh, fdk), dtype=spec.dtype, device=pool.device),
                torch.ones((1, fh, fdv), dtype=spec.dtype, device=pool.device))  # full layers need no SWA page


def _pool_checks() -> list[Check]:
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


# ---------------------------------------------------------------------------------------------
# attention checks


@attrs.frozen
class _AttentionProfile:
    dtype: torch.dtype
    head_dim: int
    v_head_dim: int
    q_heads: int
    kv_heads: int
    page_size: int


# The generic shapes every kernel should take, then the shapes Ascend FIA accepts
# (bf16/fp16, D 128 or 192/128, page sizes by its block-size rules) so each backend meets
# every feature in a configuration it can run.
ATTENTION_PROFILES = (
    _AttentionProfile(torch.float32, 64, 32, 4, 1, 16),
    _AttentionProfile(torch.float16, 48, 40, 6, 3, 16),
    _AttentionProfile(torch.bfloat16, 128, 128, 8, 2, 16),
    _AttentionProfile(torch.float16, 128, 128, 4, 4, 64),
    _AttentionProfile(torch.bfloat16, 192, 128, 8, 1, 128),
)
QUICK_PROFILES = (ATTENTION_PROFILES[0], ATTENTION_PROFILES[2], ATTENTION_PROFILES[3], ATTENTION_PROFILES[4])
MODES = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)
VARIANTS = ("plain", "sinks", "window", "hybrid window + sinks")


def _case_shapes(mode: ForwardMode, ps: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ragged batches crossing page edges; EXTEND includes a prefill without prefix."""
    long, spec_tokens = 2 * ps + 3, 4
    shapes = {
        ForwardMode.EXTEND: ((long, 7, ps), (long - 2 * ps + 1, 3, ps)),
        ForwardMode.DECODE: ((long, 1, ps + 1, 2), (1, 1, 1, 1)),
        ForwardMode.TARGET_VERIFY: ((long, ps + 2, spec_tokens), (spec_tokens,) * 3),
        ForwardMode.DRAFT_EXTEND_V2: ((ps, long, spec_tokens + 1), (spec_tokens,) * 3),
    }
    return shapes[mode]


def attention_cases(quick: bool = False) -> list[AttentionCase]:
    """The suite's attention cases: every profile x mode x variant (quick: a covering subset)."""
    cases: list[AttentionCase] = []
    profiles = QUICK_PROFILES if quick else ATTENTION_PROFILES
    for pi, prof in enumerate(profiles):
        for mi, mode in enumerate(MODES):
            variants = [VARIANTS[(mi + pi) % len(VARIANTS)]] if quick else list(VARIANTS)
            for variant in variants:
                window = {"window": 5, "hybrid window + sinks": prof.page_size + 1}.get(variant)
                layer = LayerSpec(
                    0,
                    prof.q_heads,
                    prof.kv_heads,
                    prof.head_dim,
                    prof.v_head_dim,
                    scaling=prof.head_dim**-0.5,
                    sliding_window=window,
                    has_sinks="sinks" in variant,
                )
                kv, q = _case_shapes(mode, prof.page_size)
                cases.append(
                    AttentionCase(mode, layer, kv, q, prof.page_size, prof.dtype, variant.startswith("hybrid"), len(cases))
                )
    return cases


def _case_features(case: AttentionCase) -> tuple[str, ...]:
    lay = case.layer
    features = [f"attention: {case.mode.name}"]
    if lay.sliding_window is not None:
        features.append("attention: sliding window")
    if lay.has_sinks:
        features.append("attention: sinks")
    if case.hybrid:
        features.append("attention: hybrid SWA pool")
    if lay.num_q_heads != lay.num_kv_heads:
        features.append("attention: GQA")
    if lay.head_dim != lay.v_head_dim:
        features.append("attention: qk_head_dim != v_head_dim")
    features.append(f"attention: page size {case.page_size}")
    features.append(f"attention: {_dtype_name(case.dtype)}")
    return tuple(features)


def _attention_check(case: AttentionCase) -> Check:
    def fn(backend: Backend) -> None:
        result = run_attention_case(backend, case)
        if not result.passed:
            _fail(result.detail)

    return Check(f"attention {case.describe()}", _case_features(case), fn)


# ---------------------------------------------------------------------------------------------
# graph checks: a synthetic decode loop and a synthetic MTP loop, eager vs replayed vs reference


@attrs.frozen
class LoopConfig:
    """A model-free speculative-decoding loop: target layers, draft layers, and a batch schedule.

    ``draft_steps == 0`` gives a plain DECODE loop. Otherwise each iteration runs one
    TARGET_VERIFY forward over ``draft_steps + 1`` tokens per request on the target layers,
    then ``draft_steps`` DRAFT_EXTEND_V2 forwards (one per draft layer) over the same rows,
    each step's queries built from the previous step's output; then every request advances by
    a random accept length in ``1 .. draft_steps + 1``.
    """

    label: str
    dtype: torch.dtype
    head_dim: int
    v_head_dim: int
    q_heads: int
    full_kv_heads: int
    swa_kv_heads: int
    page_size: int
    window: int
    draft_steps: int
    schedule: tuple[int, ...]  # live requests per iteration
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    seed: int = 0

    @property
    def tokens_per_request(self) -> int:
        """Query tokens per request of the verify and draft-extend forwards."""
        return self.draft_steps + 1

    @property
    def verify_mode(self) -> ForwardMode:
        """TARGET_VERIFY with draft steps, plain DECODE without."""
        return ForwardMode.TARGET_VERIFY if self.draft_steps else ForwardMode.DECODE

    def target_layers(self) -> tuple[LayerSpec, ...]:
        """One full and one SWA (with sinks) target layer."""
        scale = self.head_dim**-0.5
        return (
            LayerSpec(0, self.q_heads, self.full_kv_heads, self.head_dim, self.v_head_dim, scale),
            LayerSpec(1, self.q_heads, self.swa_kv_heads, self.head_dim, self.v_head_dim, scale, self.window, True),
        )

    def draft_layers(self) -> tuple[LayerSpec, ...]:
        """One SWA layer per draft step (the MTP blocks)."""
        scale = self.head_dim**-0.5
        return tuple(
            LayerSpec(2 + s, self.q_heads, self.swa_kv_heads, self.head_dim, self.v_head_dim, scale, self.window, True)
            for s in range(self.draft_steps)
        )

    def layers(self) -> tuple[LayerSpec, ...]:
        """Target layers, then draft layers (pool layer ids 0..n-1)."""
        return self.target_layers() + self.draft_layers()


@attrs.frozen
class _Iteration:
    live: tuple[int, ...]  # request ids, in batch order
    joins: tuple[tuple[int, int], ...]  # (request id, prompt length) prefilled first
    leaves: tuple[int, ...]  # released before this iteration
    accept: tuple[int, ...]  # accept length per live request


def _schedule(cfg: LoopConfig) -> tuple[list[_Iteration], int]:
    """The batch plan (identical in every world) and the page count a request can reach."""
    rng = random.Random(cfg.seed)
    ps, tpr = cfg.page_size, cfg.tokens_per_request
    live: list[int] = []
    lengths: dict[int, int] = {}
    next_id, most = 0, 0
    plan = []
    for size in cfg.schedule:
        leaves: list[int] = []
        while len(live) > size or (live and rng.random() < 0.3 and len(live) >= size):
            leaves.append(live.pop(rng.randrange(len(live))))
        joins = []
        while len(live) < size:
            prompt = rng.randint(ps - 6, ps + 9)  # crosses a page edge while it grows
            joins.append((next_id, prompt))
            live.append(next_id)
            lengths[next_id] = prompt
            next_id += 1
        accept = tuple(rng.randint(1, tpr) for _ in live)
        plan.append(_Iteration(tuple(live), tuple(joins), tuple(leaves), accept))
        for rid, a in zip(live, accept):
            most = max(most, lengths[rid] + tpr)
            lengths[rid] += a
    return plan, -(-most // ps)


def _loop_pool_spec(cfg: LoopConfig, plan: Sequence[_Iteration], max_pages: int) -> KVPoolSpec:
    peak = max(len(it.live) for it in plan)
    pages = peak * max_pages + 2
    layers = cfg.layers()
    return KVPoolSpec(
        num_layers=len(layers),
        size=pages * cfg.page_size,
        page_size=cfg.page_size,
        kv_heads=cfg.full_kv_heads,
        head_dim=cfg.head_dim,
        v_head_dim=cfg.v_head_dim,
        dtype=cfg.dtype,
        swa=SWAPoolSpec(
            layer_ids=tuple(lay.layer_id for lay in layers if lay.is_swa),
            size=pages * cfg.page_size,
            kv_heads=cfg.swa_kv_heads,
            head_dim=cfg.head_dim,
            v_head_dim=cfg.v_head_dim,
        ),
    )


class _LoopWorld:
    """One run of the loop on one backend, eagerly or through GraphRunners; records every output."""

    def __init__(self, backend: Backend, cfg: LoopConfig, *, use_graphs: bool) -> None:
        self.backend = backend
        self.cfg = cfg
        self.plan, self.max_pages = _schedule(cfg)
        self.pool = backend.create_kv_pool(_loop_pool_spec(cfg, self.plan, self.max_pages))
        self.attn: AttentionKernel = backend.create_attention(self.pool)
        self.table = RequestPageTable(KVAllocator(self.pool))
        self.device = self.pool.device
        self.lengths: dict[int, int] = {}
        self.outputs: dict[tuple[Any, ...], torch.Tensor] = {}
        self.problems: list[str] = []
        self.replays = 0
        dv, dk = cfg.v_head_dim, cfg.head_dim
        self.chain = (torch.randn(dv, dk, generator=_seeded(cfg, "chain")) / dv**0.5).to(self.device)
        self.sinks = {
            lay.layer_id: (torch.randn(lay.num_q_heads, generator=_seeded(cfg, "sink", lay.layer_id)) * 2)
            .bfloat16()
            .float()
            .to(self.device)
            for lay in cfg.layers()
            if lay.has_sinks
        }
        self.verify_runner: GraphRunner | None = None
        self.draft_runners: list[GraphRunner] = []
        if use_graphs:
            self.verify_runner = self._runner(cfg.verify_mode, cfg.target_layers())
            self.draft_runners = [self._runner(ForwardMode.DRAFT_EXTEND_V2, (lay,)) for lay in cfg.draft_layers()]
            for runner in (self.verify_runner, *self.draft_runners):
                runner.capture()

    # -- forwards ------------------------------------------------------------------------------
    def _forward(self, layers: Sequence[LayerSpec]) -> Callable[[Mapping[str, torch.Tensor], AttentionMetadata], Any]:
        def forward(inputs: Mapping[str, torch.Tensor], md: AttentionMetadata) -> tuple[torch.Tensor, ...]:
            return tuple(
                self.attn.forward(
                    inputs[f"q{lay.layer_id}"],
                    inputs[f"k{lay.layer_id}"],
                    inputs[f"v{lay.layer_id}"],
                    lay,
                    md,
                    sinks=self.sinks.get(lay.layer_id),
                )
                for lay in layers
            )

        return forward

    def _runner(self, mode: ForwardMode, layers: Sequence[LayerSpec]) -> GraphRunner:
        inputs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for lay in layers:
            i = lay.layer_id
            inputs[f"q{i}"] = ((lay.num_q_heads, lay.head_dim), self.cfg.dtype)
            inputs[f"k{i}"] = ((lay.num_kv_heads, lay.head_dim), self.cfg.dtype)
            inputs[f"v{i}"] = ((lay.num_kv_heads, lay.v_head_dim), self.cfg.dtype)
        return GraphRunner(
            self.backend,
            self._forward(layers),
            attention=self.attn,
            mode=mode,
            tokens_per_request=self.cfg.tokens_per_request,
            batch_sizes=self.cfg.batch_sizes,
            max_pages_per_request=self.max_pages,
            inputs=inputs,
        )

    def _run(
        self, runner: GraphRunner | None, layers: Sequence[LayerSpec], inputs: dict[str, torch.Tensor], md: AttentionMetadata, what: str
    ) -> tuple[torch.Tensor, ...]:
        if runner is None:
            return tuple(self._forward(layers)(inputs, md))
        padded = runner.padded_batch_size(md.batch_size)
        check_padding = padded is not None and padded > md.batch_size
        before = _snapshot(self.pool) if check_padding else None
        outs = runner.run(inputs, md)
        if padded is not None:
            self.replays += 1
        if before is not None:
            allowed = {}
            for lay in layers:
                rows = set(kv_rows(self.pool, lay.layer_id, md.out_cache_loc).tolist())
                allowed[lay.layer_id] = rows | set(range(self.cfg.page_size))  # the padding page
            try:
                _assert_only_rows_changed(self.pool, before, allowed, f"{what} (batch {md.batch_size} padded to {padded})")
            except ConformanceFailure as exc:
                self.problems.append(str(exc))
        return tuple(outs)

    def _qkv(self, layer: LayerSpec, rows: int, *tag: object) -> dict[str, torch.Tensor]:
        i, dt = layer.layer_id, self.cfg.dtype
        return {
            f"q{i}": _randn((rows, layer.num_q_heads, layer.head_dim), dt, self.cfg, "q", i, *tag).to(self.device),
            f"k{i}": _randn((rows, layer.num_kv_heads, layer.head_dim), dt, self.cfg, "k", i, *tag).to(self.device),
            f"v{i}": _randn((rows, layer.num_kv_heads, layer.v_head_dim), dt, self.cfg, "v", i, *tag).to(self.device),
        }

    def _metadata(self, mode: ForwardMode, batch: Sequence[int], q_len: int, kv_lens: Sequence[int]) -> AttentionMetadata:
        loc = torch.cat([self.table.slots(r, range(n - q_len, n)) for r, n in zip(batch, kv_lens)])
        return build_metadata(
            mode, kv_lens=kv_lens, q_lens=[q_len] * len(batch), page_table=self.table.table(batch), out_cache_loc=loc, pool=self.pool
        )

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        cfg, tpr = self.cfg, self.cfg.tokens_per_request
        for it_no, it in enumerate(self.plan):
            for rid in it.leaves:
                self.table.release(rid)
                del self.lengths[rid]
            for rid, prompt in it.joins:
                # The prompt's K/V go straight into the pool (prefill attention is the attention
                # checks' business; here it would only make slow emulators slower).
                self.table.reserve(rid, prompt)
                slots = self.table.slots(rid, range(prompt)).to(self.device)
                for lay in cfg.layers():
                    qkv = self._qkv(lay, prompt, "prefill", rid)
                    self.pool.set_kv(lay.layer_id, slots, qkv[f"k{lay.layer_id}"], qkv[f"v{lay.layer_id}"])
                self.lengths[rid] = prompt
            batch = list(it.live)
            kv_lens = [self.lengths[r] + tpr for r in batch]
            for r, n in zip(batch, kv_lens):
                self.table.reserve(r, n)
            rows = len(batch) * tpr
            mode = cfg.verify_mode
            md = self._metadata(mode, batch, tpr, kv_lens)
            inputs: dict[str, torch.Tensor] = {}
            for lay in cfg.target_layers():
                inputs |= self._qkv(lay, rows, "verify", it_no)
            outs = self._run(self.verify_runner, cfg.target_layers(), inputs, md, f"iteration {it_no} {mode.name}")
            for lay, out in zip(cfg.target_layers(), outs):
                self.outputs[(it_no, mode.name, lay.layer_id)] = _host(out)
            if cfg.draft_steps:
                md = self._metadata(ForwardMode.DRAFT_EXTEND_V2, batch, tpr, kv_lens)
                prev = outs[0]
                for step, lay in enumerate(cfg.draft_layers()):
                    inputs = self._qkv(lay, rows, "draft", it_no)
                    if step:  # the draft chain: step s reads step s - 1's output
                        chained = torch.einsum("thd,de->the", prev.float(), self.chain) * 0.25
                        inputs[f"q{lay.layer_id}"] = (inputs[f"q{lay.layer_id}"].float() + chained).to(cfg.dtype)
                    runner = self.draft_runners[step] if self.draft_runners else None
                    (prev,) = self._run(runner, (lay,), inputs, md, f"iteration {it_no} DRAFT_EXTEND_V2 step {step}")
                    self.outputs[(it_no, "DRAFT_EXTEND_V2", step, lay.layer_id)] = _host(prev)
            for r, a in zip(batch, it.accept):
                self.lengths[r] += a
            # The cache of every live request, as the comparison's last word on this iteration.
            for lay in cfg.layers():
                slots = torch.cat([self.table.slots(r, range(self.lengths[r] - it.accept[i] + tpr)) for i, r in enumerate(batch)])
                k, v = read_kv(self.pool, lay.layer_id, slots)
                self.outputs[(it_no, "cache", lay.layer_id)] = torch.cat([k.flatten(), v.flatten()]).float()


def _compare_worlds(got: _LoopWorld, expect: _LoopWorld, label: str) -> None:
    for key, value in expect.outputs.items():
        if key not in got.outputs:
            _fail(f"{label}: no result for {key}")
        what = f"{label} at iteration {key[0]} {' '.join(str(k) for k in key[1:])}"
        if key[1] == "cache":
            if not torch.equal(got.outputs[key], value):
                _fail(f"{what}: cached K/V of the live requests differ")
        else:
            _assert_close(got.outputs[key], value, got.cfg.dtype, what)


def _check_loop(backend: Backend, cfg: LoopConfig) -> None:
    from backends.cpu import CpuBackend

    graphed = _LoopWorld(backend, cfg, use_graphs=True)  # first: a backend without graphs says so up front
    reference = _LoopWorld(cast(Backend, CpuBackend()), cfg, use_graphs=False)
    reference.run()
    eager = _LoopWorld(backend, cfg, use_graphs=False)
    eager.run()
    _compare_worlds(eager, reference, "eager vs the CPU reference")
    graphed.run()
    if graphed.problems:
        _fail(graphed.problems[0])
    if not graphed.replays:
        _fail("the loop never replayed a captured graph")
    _compare_worlds(graphed, eager, "replayed graph vs eager")


def loop_configs(quick: bool = False) -> list[LoopConfig]:
    """The decode and MTP loops the graph checks run, in a generic and a MiMo-like shape."""
    generic = dict(dtype=torch.float32, head_dim=64, v_head_dim=32, q_heads=4, full_kv_heads=1, swa_kv_heads=2,
                   page_size=16, window=7)
    mimo = dict(dtype=torch.bfloat16, head_dim=192, v_head_dim=128, q_heads=8, full_kv_heads=1, swa_kv_heads=2,
                page_size=128, window=127)
    # Batch plans: 3 is padded to the captured 4, 5 runs eagerly, repeats replay a graph with new lengths.
    if quick:
        plans: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
            "generic": ((3, 4, 1, 5), (3, 4, 5)),
            "mimo": ((3, 4, 1, 5), (3, 4, 5)),
        }
    else:
        plans = {"generic": ((2, 3, 3, 1, 4, 5, 2), (3, 3, 2, 4, 5, 1)), "mimo": ((2, 3, 4, 5, 1), (3, 4, 2, 5))}
    out = []
    for key, shape_label, shape in (("generic", "fp32 d64/32 ps16", generic), ("mimo", "bf16 d192/128 ps128", mimo)):
        decode_plan, mtp_plan = plans[key]
        out.append(LoopConfig(f"decode [{shape_label}]", draft_steps=0, schedule=decode_plan, **shape))  # type: ignore[arg-type]
        out.append(LoopConfig(f"MTP S=3 [{shape_label}]", draft_steps=3, schedule=mtp_plan, **shape))  # type: ignore[arg-type]
    return out


def _graph_checks(quick: bool) -> list[Check]:
    checks = []
    for cfg in loop_configs(quick):
        features: tuple[str, ...]
        if cfg.draft_steps:
            features = ("graph: TARGET_VERIFY replay", "graph: DRAFT_EXTEND_V2 replay (every draft step)")
        else:
            features = ("graph: DECODE replay",)
        features += ("graph: padded batch", "graph: eager fallback", "graph: batch/kv lens change between replays")
        checks.append(Check(f"graph loop {cfg.label}", features, functools.partial(_check_loop, cfg=cfg)))
    checks.append(Check("graph replay before capture", ("errors: graph misuse",), _check_graph_misuse))
    return checks


def _check_graph_misuse(backend: Backend) -> None:
    graph = backend.create_graph()
    _expect_error(GraphError, lambda: graph.replay(), "Graph.replay() before capture()")


# ---------------------------------------------------------------------------------------------
# attention error checks


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
            _randn((rows, lay.num_q_heads, lay.head_dim), dt, tag, "q").to(dev),
            _randn((rows, lay.num_kv_heads, lay.head_dim), dt, tag, "k").to(dev),
            _randn((rows, lay.num_kv_heads, lay.v_head_dim), dt, tag, "v").to(dev),
        )

    prefill = build_metadata(ForwardMode.EXTEND, kv_lens=[n], q_lens=[n], page_table=table.table([0]),
                             out_cache_loc=table.slots(0, range(n)), pool=pool)
    for lay in (full, swa):  # a valid forward first: proves the configuration is supported
        q, k, v = tensors(lay, n, f"prefill{lay.layer_id}")
        attn.forward(q, k, v, lay, prefill, sinks=sinks if lay.has_sinks else None)
    decode = build_metadata(ForwardMode.DECODE, kv_lens=[n + 1], q_lens=[1], page_table=table.table([0]),
                            out_cache_loc=table.slots(0, [n]), pool=pool)
    no_swa_table = build_metadata(ForwardMode.DECODE, kv_lens=[n + 1], q_lens=[1], page_table=table.table([0]),
                                  out_cache_loc=table.slots(0, [n]), page_size=ps, device=dev)
    other_ps = 2 * ps
    wrong_ps = build_metadata(ForwardMode.DECODE, kv_lens=[n + 1], q_lens=[1], page_table=[[1]],
                              out_cache_loc=table.slots(0, [n]), page_size=other_ps, device=dev)
    limit = (spec.num_pages + 1) * ps
    bad_loc = build_metadata(ForwardMode.DECODE, kv_lens=[n + 1], q_lens=[1], page_table=table.table([0]),
                             out_cache_loc=[limit + 1], pool=pool)
    q, k, v = tensors(full, 1, "decode")
    sq, sk, sv = tensors(swa, 1, "decode-swa")
    other_dtype = torch.float16 if dt != torch.float16 else torch.bfloat16
    wrong_dims = attrs.evolve(full, v_head_dim=cfg.v_head_dim + 8)
    cases: list[tuple[str, type[Exception], Callable[[], Any], tuple[str, ...]]] = [
        ("q with one head too many", SpecError,
         lambda: attn.forward(torch.cat([q, q[:, :1]], 1), k, v, full, decode), (str((1, cfg.q_heads + 1, cfg.head_dim)),)),
        ("v with head_dim instead of v_head_dim", SpecError,
         lambda: attn.forward(q, k, k, full, decode), (str((1, cfg.full_kv_heads, cfg.head_dim)),)),
        ("two rows for one token", SpecError,
         lambda: attn.forward(torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]), full, decode), ()),
        (f"q of dtype {other_dtype}", KVLayoutError,
         lambda: attn.forward(q.to(other_dtype), k, v, full, decode), (str(other_dtype),)),
        ("a LayerSpec whose v_head_dim the pool does not store", KVLayoutError,
         lambda: attn.forward(q, k, v, wrong_dims, decode), (str(cfg.v_head_dim + 8),)),
        ("a sinks layer called without sinks", SpecError, lambda: attn.forward(sq, sk, sv, swa, decode), ()),
        ("sinks on a layer without them", SpecError, lambda: attn.forward(q, k, v, full, decode, sinks=sinks), ()),
        ("sinks of the wrong shape", SpecError,
         lambda: attn.forward(sq, sk, sv, swa, decode, sinks=sinks[:-1]), (str((cfg.q_heads - 1,)),)),
        ("an SWA-pool layer with metadata lacking swa_block_table", SpecError,
         lambda: attn.forward(sq, sk, sv, swa, no_swa_table, sinks=sinks), ()),
        (f"metadata with page_size {other_ps}", SpecError,
         lambda: attn.forward(q, k, v, full, wrong_ps), (str(other_ps),)),
        (f"out_cache_loc {limit + 1} outside the pool", CacheLocationError,
         lambda: attn.forward(q, k, v, full, bad_loc), (str(limit + 1),)),
    ]
    before = _snapshot(pool)
    for what, expected, call, mentions in cases:
        _expect_error(expected, call, f"attention forward with {what}", mentions)
        before = _assert_only_rows_changed(pool, before, {}, f"the rejected forward with {what}")


def _error_checks() -> list[Check]:
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


# ---------------------------------------------------------------------------------------------
# the suite and the command


def build_suite(*, quick: bool = False, select: Sequence[str] = ()) -> list[Check]:
    """Every check, in run order. ``quick`` trims the attention matrix and the loops (slow
    emulators); ``select`` keeps checks whose name or a feature contains any of the strings."""
    checks = _pool_checks() + [_attention_check(c) for c in attention_cases(quick)] + _graph_checks(quick) + _error_checks()
    if select:
        wanted = [s.lower() for s in select]
        checks = [
            c for c in checks if any(w in c.name.lower() or any(w in f.lower() for f in c.features) for w in wanted)
        ]
    return checks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hal conformance``."""
    parser.add_argument("--device", required=True, help="device string of the backend to check, e.g. cpu, npu, cuda:0, mydev")
    parser.add_argument("--emulate", action="store_true", help="install the backend's CPU emulator first (install_emulation())")
    parser.add_argument("--quick", action="store_true", help="a covering subset: every feature, fewer shapes (for slow emulators)")
    parser.add_argument("-k", "--select", action="append", default=[], metavar="TEXT",
                        help="only checks whose name or feature contains TEXT (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every check as it finishes")


def run(args: argparse.Namespace) -> int:
    """``hal conformance``: print the per-feature table; exit 1 if any check failed."""
    checks = build_suite(quick=args.quick, select=args.select)
    if args.list:
        for check in checks:
            print(f"{check.name}    ({', '.join(check.features)})")
        return 0
    if not checks:
        print(f"hal conformance: no check matches {args.select}", file=sys.stderr)
        return 2
    import hal

    backend = hal.get_backend(args.device, emulate=args.emulate)
    mode = " (emulated)" if args.emulate else ""
    print(f"hal conformance: backend {backend.name!r} on {backend.device}{mode}, {len(checks)} checks")

    def progress(i: int, n: int, result: CheckResult) -> None:
        if args.verbose or result.status is Status.FAILED:
            print(f"[{i}/{n}] {result.status.value:<11} {result.check.name} ({result.seconds:.2f}s)", file=sys.stderr)
            if result.detail and (args.verbose or result.status is Status.FAILED):
                print(f"    {result.detail}", file=sys.stderr)

    start = time.perf_counter()
    results = run_suite(backend, checks, progress=progress)
    print(format_table(results))
    failed = [r for r in results if r.status is Status.FAILED]
    unsupported = [r for r in results if r.status is Status.UNSUPPORTED]
    if unsupported:
        reasons: dict[str, int] = {}
        for r in unsupported:
            reasons[r.detail] = reasons.get(r.detail, 0) + 1
        print("\nunsupported (reason: count):")
        for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
            print(f"  {reason}: {count}")
    if failed:
        print("\nfailed:")
        for r in failed:
            print(f"  {r.check.name}: {r.detail}")
    print(f"\n{len(results) - len(failed) - len(unsupported)} passed, {len(failed)} failed, "
          f"{len(unsupported)} unsupported in {time.perf_counter() - start:.1f}s")
    return 1 if failed else 0


__all__ = [
    "ATTENTION_PROFILES",
    "Check",
    "CheckResult",
    "ConformanceFailure",
    "FeatureRow",
    "LoopConfig",
    "Status",
    "add_arguments",
    "attention_cases",
    "build_suite",
    "format_table",
    "loop_configs",
    "run",
    "run_check",
    "run_suite",
    "summarize",
]
