"""Graph checks: a synthetic decode loop and a synthetic MTP loop through ``hal.GraphRunner``, eager vs
replayed vs the oracle, with growing lengths, changing batches, padding and the eager fallback."""

from __future__ import annotations

import functools
import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import attrs
import torch

from hal.allocator import KVAllocator, RequestPageTable
from hal.errors import BatchTooLargeError, GraphError
from hal.graph_runner import GraphRunner
from hal.metadata import AttentionMetadata, build_metadata
from hal.oracle import OracleAttention
from hal.protocols import AttentionKernel, Backend
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec
from hal.tree import tree_mask_from_parents
from hal.tools.testing import kv_rows, read_kv
from hal.tools.conformance.framework import Check, ConformanceFailure, assert_close, assert_only_rows_changed, expect_error, fail, host, randn, seeded, snapshot


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
    tree_verify: bool = False  # verify each iteration's drafts as random trees (a new tree per request and step)

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

    def __init__(self, backend: Backend, cfg: LoopConfig, *, use_graphs: bool, oracle: bool = False) -> None:
        self.backend = backend
        self.cfg = cfg
        self.plan, self.max_pages = _schedule(cfg)
        self.pool = backend.create_kv_pool(_loop_pool_spec(cfg, self.plan, self.max_pages))
        # Garbage in every slot: a write where none belongs (a padded row's, say) changes the pool
        # even when it writes what an untouched slot would hold.
        for layer in range(self.pool.spec.num_layers):
            for name, buffer in (("k", self.pool.k_buffer(layer)), ("v", self.pool.v_buffer(layer))):
                buffer.copy_(randn(buffer.shape, cfg.dtype, cfg, "garbage", name, layer).to(self.pool.device))
        self.attn: AttentionKernel = OracleAttention(self.pool) if oracle else backend.create_attention(self.pool)
        self.table = RequestPageTable(KVAllocator(self.pool))
        self.device = self.pool.device
        self.lengths: dict[int, int] = {}
        self.outputs: dict[tuple[Any, ...], torch.Tensor] = {}
        self.problems: list[str] = []
        self.replays = 0
        dv, dk = cfg.v_head_dim, cfg.head_dim
        self.chain = (torch.randn(dv, dk, generator=seeded(cfg, "chain")) / dv**0.5).to(self.device)
        self.sinks = {
            lay.layer_id: (torch.randn(lay.num_q_heads, generator=seeded(cfg, "sink", lay.layer_id)) * 2)
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
            # A capture writes its placeholder batch to the padding page only (every slot 0).
            before = snapshot(self.pool)
            for runner in (self.verify_runner, *self.draft_runners):
                runner.capture()
            padding_page = set(range(cfg.page_size))
            try:
                assert_only_rows_changed(self.pool, before, {lay.layer_id: padding_page for lay in cfg.layers()}, "graph capture")
            except ConformanceFailure as exc:
                self.problems.append(str(exc))

    # -- forwards ------------------------------------------------------------------------------
    def _forward(self, layers: Sequence[LayerSpec]) -> Callable[[Mapping[str, torch.Tensor], AttentionMetadata], Any]:
        def forward(inputs: Mapping[str, torch.Tensor], md: AttentionMetadata) -> tuple[torch.Tensor, ...]:
            return tuple(
                self.attn.forward(
                    inputs[f"q{lay.layer_id}"],
                    inputs[f"k{lay.layer_id}"],
                    inputs[f"v{lay.layer_id}"],
                    lay,
                    self.attn.plan(md),
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
            replay_captured=True,
            trees=self.cfg.tree_verify and mode is ForwardMode.TARGET_VERIFY,
        )

    def _run(
        self, runner: GraphRunner | None, layers: Sequence[LayerSpec], inputs: dict[str, torch.Tensor], md: AttentionMetadata, what: str
    ) -> tuple[torch.Tensor, ...]:
        if runner is None:
            return tuple(self._forward(layers)(inputs, md))
        padded = runner.padded_batch_size(md.batch_size)
        check_padding = padded is not None and padded > md.batch_size
        before = snapshot(self.pool) if check_padding else None
        outs = runner.run(inputs, md)
        if padded is not None:
            self.replays += 1
        if before is not None:
            allowed = {}
            for lay in layers:
                rows = set(kv_rows(self.pool, lay.layer_id, md.out_cache_loc).tolist())
                allowed[lay.layer_id] = rows | set(range(self.cfg.page_size))  # the padding page
            try:
                assert_only_rows_changed(self.pool, before, allowed, f"{what} (batch {md.batch_size} padded to {padded})")
            except ConformanceFailure as exc:
                self.problems.append(str(exc))
        return tuple(outs)

    def _qkv(self, layer: LayerSpec, rows: int, *tag: object) -> dict[str, torch.Tensor]:
        i, dt = layer.layer_id, self.cfg.dtype
        return {
            f"q{i}": randn((rows, layer.num_q_heads, layer.head_dim), dt, self.cfg, "q", i, *tag).to(self.device),
            f"k{i}": randn((rows, layer.num_kv_heads, layer.head_dim), dt, self.cfg, "k", i, *tag).to(self.device),
            f"v{i}": randn((rows, layer.num_kv_heads, layer.v_head_dim), dt, self.cfg, "v", i, *tag).to(self.device),
        }

    def _metadata(
        self, mode: ForwardMode, batch: Sequence[int], q_len: int, kv_lens: Sequence[int], iteration: int = 0
    ) -> AttentionMetadata:
        loc = torch.cat([self.table.slots(r, range(n - q_len, n)) for r, n in zip(batch, kv_lens)])
        tree = None
        if self.cfg.tree_verify and mode is ForwardMode.TARGET_VERIFY:
            rng = random.Random(zlib.crc32(repr((self.cfg, "tree", iteration)).encode()))
            tree = tree_mask_from_parents([[-1] + [rng.randrange(i) for i in range(1, q_len)] for _ in batch])
        return build_metadata(
            mode, kv_lens=kv_lens, q_lens=[q_len] * len(batch), page_table=self.table.table(batch), out_cache_loc=loc,
            pool=self.pool, tree_mask=tree,
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
            md = self._metadata(mode, batch, tpr, kv_lens, it_no)
            inputs: dict[str, torch.Tensor] = {}
            for lay in cfg.target_layers():
                inputs |= self._qkv(lay, rows, "verify", it_no)
            outs = self._run(self.verify_runner, cfg.target_layers(), inputs, md, f"iteration {it_no} {mode.name}")
            for lay, out in zip(cfg.target_layers(), outs):
                self.outputs[(it_no, mode.name, lay.layer_id)] = host(out)
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
                    self.outputs[(it_no, "DRAFT_EXTEND_V2", step, lay.layer_id)] = host(prev)
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
            fail(f"{label}: no result for {key}")
        what = f"{label} at iteration {key[0]} {' '.join(str(k) for k in key[1:])}"
        if key[1] == "cache":
            if not torch.equal(got.outputs[key], value):
                fail(f"{what}: cached K/V of the live requests differ")
        else:
            assert_close(got.outputs[key], value, got.cfg.dtype, what)


def _check_loop(backend: Backend, cfg: LoopConfig) -> None:
    from hal.backends.cpu import CpuBackend

    graphed = _LoopWorld(backend, cfg, use_graphs=True)  # first: a backend without graphs says so up front
    oracle = _LoopWorld(cast(Backend, CpuBackend()), cfg, use_graphs=False, oracle=True)
    oracle.run()
    eager = _LoopWorld(backend, cfg, use_graphs=False)
    eager.run()
    _compare_worlds(eager, oracle, "eager vs the oracle")
    graphed.run()
    if graphed.problems:
        fail(graphed.problems[0])
    if not graphed.replays:
        fail("the loop never replayed a captured graph")
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
    # Tree verify: 5 verify rows per request in a new random tree every iteration.
    out.append(LoopConfig("tree verify S=4 [bf16 d192/128 ps128]", draft_steps=4, schedule=plans["mimo"][1], tree_verify=True,
                          **mimo))  # type: ignore[arg-type]
    return out


def graph_checks(quick: bool) -> list[Check]:
    checks = []
    for cfg in loop_configs(quick):
        features: tuple[str, ...]
        if cfg.tree_verify:
            features = ("graph: TARGET_VERIFY tree replay",)
        elif cfg.draft_steps:
            features = ("graph: TARGET_VERIFY replay", "graph: DRAFT_EXTEND_V2 replay (every draft step)")
        else:
            features = ("graph: DECODE replay",)
        features += ("graph: padded batch", "graph: eager fallback", "graph: batch/kv lens change between replays")
        checks.append(Check(f"graph loop {cfg.label}", features, functools.partial(_check_loop, cfg=cfg)))
    checks.append(Check("graph replay before capture", ("errors: graph misuse",), _check_graph_misuse))
    checks.append(Check("graph runner contract", ("errors: graph misuse",), _check_runner_contract))
    return checks


def _check_graph_misuse(backend: Backend) -> None:
    graph = backend.create_graph()
    expect_error(GraphError, lambda: graph.replay(), "Graph.replay() before capture()")


def _check_runner_contract(backend: Backend) -> None:
    """``hal.GraphRunner`` refuses, on every backend (whether it replays graphs or runs batches
    eagerly), what a replaying runner refuses with eager fallback off, with the same error class
    and message and before anything is written: a run before ``capture()``, a batch larger than
    the largest captured size, a block table wider than captured."""
    dtype, d, ps = torch.bfloat16, 128, 16  # every built-in kernel takes bf16, head dim 128, pages of 16
    layer = LayerSpec(0, 2, 1, d, d, scaling=d**-0.5)
    pool = backend.create_kv_pool(KVPoolSpec(1, 8 * ps, ps, 1, d, d, dtype))
    attention = backend.create_attention(pool)

    def forward(inputs: Mapping[str, torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        return attention.forward(inputs["q"], inputs["k"], inputs["v"], layer, attention.plan(metadata))

    runner = GraphRunner(
        backend, forward, attention=attention, mode=ForwardMode.DECODE, tokens_per_request=1, batch_sizes=[1, 2],
        max_pages_per_request=2, inputs={"q": ((2, d), dtype), "k": ((1, d), dtype), "v": ((1, d), dtype)}, eager_fallback=False,
    )  # fmt: skip

    def run(batch: int, pages: int) -> Callable[[], Any]:
        metadata = build_metadata(
            ForwardMode.DECODE, kv_lens=[3] * batch, q_lens=[1] * batch, page_table=[[1 + b] for b in range(batch)],
            out_cache_loc=[(1 + b) * ps + 2 for b in range(batch)], pool=pool, max_pages=pages,
        )  # fmt: skip
        inputs = {name: randn((batch, h, d), dtype, "runner contract", name, batch).to(pool.device) for name, h in (("q", 2), ("k", 1), ("v", 1))}
        return lambda: runner.run(inputs, metadata)

    before = snapshot(pool)
    expect_error(GraphError, run(1, 2), "GraphRunner.run before capture()", mentions=("capture() first",))
    runner.capture()
    before = assert_only_rows_changed(pool, before, {}, "GraphRunner.capture")  # padding rows only write page 0
    expect_error(BatchTooLargeError, run(3, 2), "GraphRunner.run of 3 requests, captured 1 and 2",
                 mentions=("batch of 3 is larger than every captured graph [1, 2]",))  # fmt: skip
    expect_error(BatchTooLargeError, run(1, 3), "GraphRunner.run with a block table of 3 pages, captured 2",
                 mentions=("block table of 3 pages exceeds the captured 2",))  # fmt: skip
    assert_only_rows_changed(pool, before, {}, "refused GraphRunner.run calls")
