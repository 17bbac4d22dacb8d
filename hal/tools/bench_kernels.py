"""``hal bench``'s kernel-level workloads: KV writes, paged attention against dense SDPA, the
per-call cost of going through hal's objects, and the split K/V layout's memory."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from hal.allocator import KVAllocator, RequestPageTable
from hal.attention import AttentionKernelBase
from hal.kv_pool import SplitKVPool
from hal.errors import ResultMismatchError
from hal.metadata import build_metadata
from hal.protocols import Backend
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec
from hal.tools.measurement import Measurement, judged, seconds_per_call, time_pair

# MiMo-V2-Flash attention (see the reference notes): 48 layers, 9 full + 39 SWA, qk 192 / v 128.
MIMO_LAYERS, MIMO_FULL_LAYERS = 48, (0, 5, 11, 17, 23, 29, 35, 41, 47)
MIMO_FULL_KV_HEADS, MIMO_SWA_KV_HEADS, MIMO_QK_DIM, MIMO_V_DIM = 4, 8, 192, 128


@attrs.frozen
class BenchConfig:
    """Sizes of the timed workloads (``quick`` shrinks them for smoke runs)."""

    decode_batch: int = 8
    decode_kv_len: int = 1024
    extend_len: int = 512
    write_tokens: int = 4096
    q_heads: int = 16
    kv_heads: int = MIMO_FULL_KV_HEADS
    head_dim: int = MIMO_QK_DIM
    v_head_dim: int = MIMO_V_DIM
    page_size: int = 128
    window: int = 127  # MiMo-V2-Flash's sliding window (hal's W: the last W + 1 keys)
    window_kv_lens: tuple[int, ...] = (4096, 16384)
    repeats: int = 15
    warmup: int = 3
    min_sample_s: float = 0.002  # a timed sample repeats the op until it lasts about this long

    @classmethod
    def quick(cls) -> BenchConfig:
        """Small shapes and few repeats, for smoke runs."""
        return cls(decode_batch=2, decode_kv_len=256, extend_len=128, write_tokens=512, window_kv_lens=(1024,), repeats=5, warmup=1)


@attrs.define
class _Setup:
    backend: Backend
    dtype: torch.dtype
    cfg: BenchConfig

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def layer(self) -> LayerSpec:
        c = self.cfg
        return LayerSpec(0, c.q_heads, c.kv_heads, c.head_dim, c.v_head_dim, scaling=c.head_dim**-0.5)

    def pool_and_table(self, lengths: Sequence[int]) -> tuple[Any, RequestPageTable]:
        c = self.cfg
        pages = sum(-(-n // c.page_size) for n in lengths) + 1
        spec = KVPoolSpec(1, pages * c.page_size, c.page_size, c.kv_heads, c.head_dim, c.v_head_dim, self.dtype)
        pool = self.backend.create_kv_pool(spec)
        table = RequestPageTable(KVAllocator(pool))
        for r, n in enumerate(lengths):
            table.reserve(r, n)
        return pool, table

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, dtype=torch.float32).to(self.dtype).to(self.device)


def bench_kv_write(s: _Setup, tokens: int) -> list[Measurement]:
    """``set_kv`` vs a contiguous ``copy_`` of the same bytes (the target), and vs the bare
    scattered ``index_copy_`` it performs (what hal's validation and routing add)."""
    c = s.cfg
    pool, table = s.pool_and_table([tokens])
    loc = table.slots(0, torch.randperm(tokens)).to(s.device)  # scattered, as decode writes are
    k, v = s.randn(tokens, c.kv_heads, c.head_dim), s.randn(tokens, c.kv_heads, c.v_head_dim)
    dst_k, dst_v = torch.empty_like(k), torch.empty_like(v)
    kflat = pool.k_buffer(0).view(-1, c.kv_heads, c.head_dim)
    vflat = pool.v_buffer(0).view(-1, c.kv_heads, c.v_head_dim)

    def hal_write() -> None:
        pool.set_kv(0, loc, k, v)

    def plain_copy() -> None:
        dst_k.copy_(k)
        dst_v.copy_(v)

    def bare_scatter() -> None:
        kflat.index_copy_(0, loc, k)
        vflat.index_copy_(0, loc, v)

    nbytes = (k.numel() + v.numel()) * k.element_size()
    out = []
    for baseline, label, ratio_of, target in (
        (plain_copy, "copy_", "hal/copy throughput", ">= 0.5"),
        (bare_scatter, "bare index_copy_", "hal/index_copy_ throughput", ""),
    ):
        pt = time_pair(s.backend, hal_write, baseline, repeats=c.repeats, warmup=c.warmup, min_sample_s=c.min_sample_s)
        out.append(judged(f"KV write, {tokens} scattered tokens (set_kv vs {label})", nbytes / pt.a / 1e9,
                          nbytes / pt.b / 1e9, "GB/s", [1 / r for r in pt.ratios], ratio_of, target))
    return out


def _dense_kv(pool: Any, table: RequestPageTable, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's K/V gathered into dense ``[B, kv_heads, L, dim]`` (equal lengths)."""
    kb, vb = pool.k_buffer(0), pool.v_buffer(0)
    ks, vs = [], []
    for r, n in enumerate(lengths):
        slots = table.slots(r, range(n)).to(kb.device)
        ks.append(kb.reshape(-1, kb.shape[-2], kb.shape[-1])[slots].transpose(0, 1))
        vs.append(vb.reshape(-1, vb.shape[-2], vb.shape[-1])[slots].transpose(0, 1))
    return torch.stack(ks), torch.stack(vs)


def _dense_baselines(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, decode: bool
) -> dict[str, Callable[[], torch.Tensor]]:
    """Exact dense SDPA formulations of the same attention; the benchmark times the fastest.

    ``q`` is ``[B, Hq, Lq, Dk]``, ``k``/``v`` are ``[B, Hkv, L, D]``. Torch's fused CPU kernel
    needs equal qk and v dims, so one variant pads V to ``Dk`` and slices the output; in decode
    (one query, no mask) the query heads of a group can also ride as query rows of their kv head.
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    b, hq, lq, dk = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    group = hq // hkv
    causal = not decode  # extend here is a full prefill: q_len == kv_len, so top-left causal is right
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    v_pad = torch.nn.functional.pad(v_rep, (0, dk - dv)) if dk > dv else v_rep
    out: dict[str, Callable[[], torch.Tensor]] = {
        "enable_gqa": lambda: sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=True),
        "K/V repeated per q head": lambda: sdpa(q, k_rep, v_rep, is_causal=causal, scale=scale),
        "K/V repeated, V padded to qk dim": lambda: sdpa(q, k_rep, v_pad, is_causal=causal, scale=scale)[..., :dv],
    }
    if decode:
        q_rows = q.reshape(b, hkv, group * lq, dk)
        v_rows_pad = torch.nn.functional.pad(v, (0, dk - dv)) if dk > dv else v

        def rows(vv: torch.Tensor) -> Callable[[], torch.Tensor]:
            return lambda: sdpa(q_rows, k, vv, scale=scale)[..., :dv].reshape(b, hq, lq, dv)

        out["group heads as query rows"] = rows(v)
        out["group heads as query rows, V padded"] = rows(v_rows_pad)
    return out


def _fastest(backend: Backend, candidates: dict[str, Callable[[], Any]]) -> tuple[str, Callable[[], Any]]:
    times = {}
    for name, fn in candidates.items():
        fn()
        times[name] = statistics.median(seconds_per_call(backend, fn, 1) for _ in range(3))
    best = min(times, key=lambda n: times[n])
    return best, candidates[best]


def bench_attention(s: _Setup, mode: ForwardMode, *, window: int | None = None, kv_len: int | None = None) -> Measurement:
    """Paged attention (no KV write) vs the fastest exact dense SDPA on the same gathered K/V; with
    ``window``, a sliding-window decode against SDPA over the last ``window + 1`` keys only."""
    c, layer = s.cfg, s.layer()
    decode = mode is ForwardMode.DECODE
    if window is not None:
        layer = attrs.evolve(layer, sliding_window=window)
    if decode:
        batch, kv_len, q_len = c.decode_batch, kv_len or c.decode_kv_len, 1
    else:
        batch, kv_len, q_len = 1, c.extend_len, c.extend_len
    lengths = [kv_len] * batch
    pool, table = s.pool_and_table(lengths)
    prefix = kv_len - q_len
    for r in range(batch):  # fill the whole cache once; the timed forwards do not write
        slots = table.slots(r, range(kv_len)).to(s.device)
        pool.set_kv(0, slots, s.randn(kv_len, c.kv_heads, c.head_dim), s.randn(kv_len, c.kv_heads, c.v_head_dim))
    md = build_metadata(
        mode, kv_lens=lengths, q_lens=[q_len] * batch, page_table=table.table(range(batch)),
        out_cache_loc=torch.cat([table.slots(r, range(prefix, kv_len)) for r in range(batch)]), pool=pool,
    )
    attn = s.backend.create_attention(pool)
    q = s.randn(batch * q_len, c.q_heads, c.head_dim)
    k_new, v_new = s.randn(batch * q_len, c.kv_heads, c.head_dim), s.randn(batch * q_len, c.kv_heads, c.v_head_dim)
    dense_k, dense_v = _dense_kv(pool, table, lengths)
    if window is not None:  # what a window layer reads: the last W + 1 keys
        dense_k, dense_v = dense_k[:, :, -(window + 1) :].contiguous(), dense_v[:, :, -(window + 1) :].contiguous()
    dense_q = q.view(batch, q_len, c.q_heads, c.head_dim).transpose(1, 2).contiguous()

    plan = attn.plan(md)  # one plan per forward, shared by a model's layers: timed per layer without it

    def paged() -> torch.Tensor:
        return attn.forward(q, k_new, v_new, layer, plan, save_kv_cache=False)

    baselines = _dense_baselines(dense_q, dense_k, dense_v, layer.scaling, decode)
    expect = paged().float().view(batch, q_len, c.q_heads, c.v_head_dim).transpose(1, 2).cpu()
    atol = 2e-5 if s.dtype == torch.float32 else 3e-2
    for name, fn in baselines.items():  # every baseline computes the same attention as the paged kernel
        got = fn().float().cpu()
        if not torch.allclose(got, expect, atol=atol, rtol=atol):
            raise ResultMismatchError(f"dense baseline {name!r} disagrees with the paged kernel by {float((got - expect).abs().max()):.3g}")
    best, dense = _fastest(s.backend, baselines)
    pt = time_pair(s.backend, paged, dense, repeats=c.repeats, warmup=c.warmup, min_sample_s=c.min_sample_s)
    shape = f"B={batch}, kv={kv_len}" + ("" if decode else f", q={q_len}")
    if window is not None:
        return judged(f"paged sliding-window decode (W={window}, {shape}) vs SDPA over the window [{best}]", pt.a * 1e3,
                      pt.b * 1e3, "ms", pt.ratios, "hal/SDPA time", "<= 2")
    return judged(f"paged {mode.name.lower()} attention ({shape}) vs SDPA [{best}]", pt.a * 1e3, pt.b * 1e3, "ms",
                  pt.ratios, "hal/SDPA time", "<= 1.5" if decode else "")


def _dispatch_pair(s: _Setup, batch: int, kv_len: int) -> tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]] | None:
    """(forward through hal, the backend's own ops called directly, metadata build and plan) for one decode
    step; None for a backend not built on hal's pool and kernel bases (no own ops to call)."""
    c, layer = s.cfg, s.layer()
    lengths = [kv_len] * batch
    pool, table = s.pool_and_table(lengths)
    attn = s.backend.create_attention(pool)
    if not isinstance(pool, SplitKVPool) or not isinstance(attn, AttentionKernelBase):
        return None
    pages = table.table(range(batch))
    loc = torch.cat([table.slots(r, [kv_len - 1]) for r in range(batch)])
    q = s.randn(batch, c.q_heads, c.head_dim)
    k, v = s.randn(batch, c.kv_heads, c.head_dim), s.randn(batch, c.kv_heads, c.v_head_dim)

    def plan_step() -> Any:
        md = build_metadata(ForwardMode.DECODE, kv_lens=lengths, q_lens=[1] * batch, page_table=pages, out_cache_loc=loc, pool=pool)
        return attn.plan(md)

    plan = plan_step()
    kflat = pool.k_buffer(0).view(-1, c.kv_heads, c.head_dim)
    vflat = pool.v_buffer(0).view(-1, c.kv_heads, c.v_head_dim)
    loc_d = loc.to(s.device)
    attn.forward(q, k, v, layer, plan)  # what the kernel derives once per forward is derived now

    def through_hal() -> None:
        attn.forward(q, k, v, layer, plan)

    def direct() -> None:
        pool._write_rows(kflat, loc_d, k)  # the backend's own row write, without validation and routing
        pool._write_rows(vflat, loc_d, v)
        attn._attend(q, layer, plan, None)  # the backend's own kernel, without forward's checks

    return through_hal, direct, plan_step


def bench_dispatch(s: _Setup) -> list[Measurement]:
    """A decode forward through hal's objects vs the backend's own write and attention ops called
    directly.

    Both sides get the step's tensors ready-made (an engine builds the metadata and its plan once
    per step and shares them across layers); that build is reported separately, per step. hal's
    cost is a per-call constant (validation, routing), a few percent of timing noise at real
    sizes, so it is also measured where it dominates (one request, one page) and related to the
    real forward: that row carries the target.
    """
    c = s.cfg
    real = _dispatch_pair(s, c.decode_batch, c.decode_kv_len)
    tiny = _dispatch_pair(s, 1, c.page_size)
    if real is None or tiny is None:
        return []
    through_hal, direct, plan_step = real
    timing = dict(repeats=c.repeats, warmup=c.warmup, min_sample_s=c.min_sample_s)
    pt = time_pair(s.backend, through_hal, direct, **timing)  # type: ignore[arg-type]
    t_hal, t_direct = pt.a, pt.b
    # Minimum of the samples: a constant cost shows in the fastest runs, interference only slows.
    tiny_pt = time_pair(s.backend, tiny[0], tiny[1], repeats=c.repeats, warmup=c.warmup,
                        min_sample_s=max(c.min_sample_s, 0.02), stat=min)
    per_call = tiny_pt.a - tiny_pt.b
    overhead = per_call / t_direct * 100
    md_pt = time_pair(s.backend, plan_step, through_hal, **timing)  # type: ignore[arg-type]
    t_md, t_fwd = md_pt.a, md_pt.b
    shape = f"B={c.decode_batch}, kv={c.decode_kv_len}"
    return [
        judged(f"dispatch: decode forward via hal vs direct ops, side by side ({shape})", t_hal * 1e3,
               t_direct * 1e3, "ms", [(r - 1) * 100 for r in pt.ratios], "difference %"),
        Measurement(f"dispatch: hal's per-call cost (measured at B=1, one page) vs the direct forward ({shape})",
                    per_call * 1e3, t_direct * 1e3, "ms", overhead, "overhead %", "<= 2", overhead <= 2),
        Measurement(f"build_metadata + plan per step (B={c.decode_batch}) vs one layer's forward", t_md * 1e3, t_fwd * 1e3, "ms",
                    md_pt.a_over_b * 100, "% of one layer"),
    ]


def mimo_pool_spec(tokens: int = 4096, page_size: int = 128) -> KVPoolSpec:
    """A bf16 hybrid pool with MiMo-V2-Flash's 48 attention layers (9 full, 39 SWA)."""
    swa_ids = tuple(i for i in range(MIMO_LAYERS) if i not in MIMO_FULL_LAYERS)
    return KVPoolSpec(
        num_layers=MIMO_LAYERS, size=tokens, page_size=page_size, kv_heads=MIMO_FULL_KV_HEADS,
        head_dim=MIMO_QK_DIM, v_head_dim=MIMO_V_DIM, dtype=torch.bfloat16,
        swa=SWAPoolSpec(swa_ids, tokens, MIMO_SWA_KV_HEADS, MIMO_QK_DIM, MIMO_V_DIM),
    )


def bench_memory() -> list[Measurement]:
    """Split K/V (hal's layout) vs a shared buffer padded to max(qk, v) dims, bf16, per token."""
    spec = mimo_pool_spec()
    split_total = spec.bytes_per_token()
    elem = 2
    padded_dim = max(MIMO_QK_DIM, MIMO_V_DIM)
    out = []
    n_full, n_swa = len(MIMO_FULL_LAYERS), MIMO_LAYERS - len(MIMO_FULL_LAYERS)
    padded_total = 0
    for label, heads, count in (("full", MIMO_FULL_KV_HEADS, n_full), ("SWA", MIMO_SWA_KV_HEADS, n_swa)):
        split = heads * (MIMO_QK_DIM + MIMO_V_DIM) * elem
        padded = heads * 2 * padded_dim * elem
        padded_total += padded * count
        out.append(Measurement(f"KV bytes/token, one MiMo {label} layer ({heads} kv heads)", split, padded, "B",
                               (1 - split / padded) * 100, "saving % vs padded"))
    out.append(Measurement(f"KV bytes/token, all 48 MiMo layers ({n_full} full + {n_swa} SWA)", split_total, padded_total,
                           "B", (1 - split_total / padded_total) * 100, "saving % vs padded"))
    return out
