"""Attention checks: every forward mode crossed with window, sinks, hybrid pools, GQA, head dims, page
sizes and dtypes, each against the oracle on identical pool contents."""

from __future__ import annotations

import random

import attrs
import torch

from hal.protocols import Backend
from hal.spec import ForwardMode, LayerSpec
from hal.tools.testing import AttentionCase, run_attention_case
from hal.tools.conformance.framework import Check, dtype_name, fail


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


# Draft trees of the tree-verify cases: depth 1-6, widths 1-8 per level (N up to 1 + 6 * 8 rows),
# levels kept small enough that the Triton interpreter runs them in seconds.
TREE_DEPTHS = (1, 2, 3, 4, 5, 6)
MAX_TREE_WIDTH = 8
MAX_TREE_ROWS = 24


def random_tree_parents(rng: random.Random, depth: int, widths: tuple[int, ...]) -> tuple[int, ...]:
    """Parents of one verify block (``hal.tree_mask_from_parents``): a root, then ``widths[d]`` rows
    at depth ``d + 1``, level after level, each hanging from a random row of the level above."""
    parents, level = [-1], [0]
    for d in range(depth):
        below = []
        for _ in range(widths[d]):
            below.append(len(parents))
            parents.append(rng.choice(level))
        level = below
    return tuple(parents)


def tree_cases(quick: bool = False) -> list[AttentionCase]:
    """TARGET_VERIFY over random draft trees (every request its own tree of one shape), on every
    profile and variant: a long prefix crossing pages, a short one, none. A window of 3 positions
    hides the upper levels from deep rows, so positions must follow depth."""
    rng = random.Random(20261205)
    cases: list[AttentionCase] = []
    profiles = QUICK_PROFILES if quick else ATTENTION_PROFILES
    for pi, prof in enumerate(profiles):
        variants = [VARIANTS[pi % len(VARIANTS)]] if quick else list(VARIANTS)
        for variant in variants:
            depth = TREE_DEPTHS[(len(cases) * 5 + pi) % len(TREE_DEPTHS)]
            widths = tuple(rng.randint(1, MAX_TREE_WIDTH) for _ in range(depth))
            while 1 + sum(widths) > MAX_TREE_ROWS:
                widths = tuple(max(1, w // 2) for w in widths)
            parents = tuple(random_tree_parents(rng, depth, widths) for _ in range(3))
            n = len(parents[0])
            window = {"window": 3, "hybrid window + sinks": 3}.get(variant)
            layer = LayerSpec(0, prof.q_heads, prof.kv_heads, prof.head_dim, prof.v_head_dim,
                              scaling=prof.head_dim**-0.5, sliding_window=window, has_sinks="sinks" in variant)
            kv = (2 * prof.page_size + n + 3, n + 2, n)
            cases.append(AttentionCase(ForwardMode.TARGET_VERIFY, layer, kv, (n,) * 3, prof.page_size, prof.dtype,
                                       variant.startswith("hybrid"), 7000 + len(cases), tree_parents=parents))
    return cases


def _case_features(case: AttentionCase) -> tuple[str, ...]:
    lay = case.layer
    features = [f"attention: {case.mode.name}"]
    if case.tree_parents is not None:
        features.append("attention: tree verify")
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
    features.append(f"attention: {dtype_name(case.dtype)}")
    return tuple(features)


def attention_check(case: AttentionCase, *, poison_unseen: bool = False, poison_new_key: bool = False) -> Check:
    """``case`` against the oracle; with ``poison_unseen``, over a pool whose rows that no token
    of the case owns hold NaN (K) and inf (V): pages are reused, and a kernel that reads a page's
    tail or a shared window must mask those values out, not multiply them by zero. With
    ``poison_new_key``, one new row's key per request is NaN: it reaches exactly the rows that see
    it (as NaN, never as a finite stand-in), and no row the causal or tree mask hides it from."""

    def fn(backend: Backend) -> None:
        result = run_attention_case(backend, case, poison_unseen=poison_unseen, poison_new_key=poison_new_key)
        if not result.passed:
            fail(result.detail)

    if poison_unseen:
        return Check(f"attention, NaN/inf in unseen slots, {case.describe()}", ("attention: NaN/inf in unseen slots",), fn)
    if poison_new_key:
        return Check(f"attention, NaN in a new row's key, {case.describe()}", ("attention: NaN/inf in a new row",), fn)
    return Check(f"attention {case.describe()}", _case_features(case), fn)


def unseen_slot_cases() -> list[AttentionCase]:
    """Every mode with and without a window and sinks, pages partly filled (a tail no row sees) and
    requests of unequal lengths: the quick suite's cases, trees included."""
    return attention_cases(quick=True) + tree_cases(quick=True)


def new_row_key_cases() -> list[AttentionCase]:
    """Blocks of several new rows per request (prefill, extend, chain and tree verify, draft
    extend), with and without window and sinks: the quick suite's cases that have them."""
    return [c for c in attention_cases(quick=True) + tree_cases(quick=True) if max(c.q_lens) >= 2]
