"""The conformance suite: one set of checks every backend must pass, against the oracle
(``hal.oracle``: attention by its definition, as dense float64 math). The CPU backend is held to
it like every other.

Run it on any registered backend, third-party ones included::

    hal conformance --device npu --emulate          # the CLI
    pytest --hal-device=npu --hal-emulate           # the pytest plugin (hal.tools.pytest_plugin)
    hal.tools.conformance.run_suite(hal.get_backend("mydev"), hal.tools.conformance.build_suite())

Modules: ``framework`` (checks, results, runner, table, assertion helpers), ``pool_checks``,
``attention_checks``, ``graph_checks``, ``error_checks``; ``command`` is ``hal conformance``.

What it checks (each check lists the features it exercises; the report counts per feature):

- KV pool layout: buffer shapes and dtypes, round trips, no aliasing across layers, slots and
  K vs V, SWA sub-pool routing through the page mapping, bad writes raise a typed error and
  change nothing.
- Attention: every forward mode crossed with sliding window, sinks, hybrid SWA pools, GQA,
  qk_head_dim != v_head_dim, page sizes 16/64/128 and float32/float16/bfloat16, each compared
  with ``hal.oracle.paged_oracle`` on identical pool contents (``hal.tools.testing``). Outputs
  must agree within ``hal.tools.testing.TOLERANCE[dtype]`` (about two ulps of the output dtype at
  magnitude 1: fp32 2e-5, fp16 2e-3, bf16 1.6e-2, absolute and relative); cached K/V must be
  bit-identical and rows of no token must stay untouched.
- Unseen slots: the quick attention cases again over a pool whose rows that no token of the case
  owns hold NaN (K) and inf (V), padding page included, as a reused page may: the output must
  equal the oracle's over a clean pool and be finite (a kernel that reads a page's tail or a
  shared window must mask, not multiply by zero: 0 x NaN is NaN).
- Graphs, through ``hal.GraphRunner`` on the backend's own ``Graph``: a DECODE loop and a
  synthetic MTP loop (TARGET_VERIFY over S + 1 tokens, then S DRAFT_EXTEND_V2 steps, each fed
  by the previous step's output) with kv lengths growing and the batch changing between
  replays, padded batches and the eager fallback above the largest captured size. At every
  step the replayed result must equal the backend's eager result, which must equal the
  oracle's; padded rows may write the padding page only.
- Errors: bad attention inputs and graph misuse raise the documented ``hal.errors`` types
  and leave the cache unchanged.

A check whose configuration the backend declines with ``hal.errors.UnsupportedConfigError``
is reported as "unsupported", not "failed".
"""

from __future__ import annotations

from collections.abc import Sequence

from hal.tools.conformance.attention_checks import (
    ATTENTION_PROFILES,
    attention_cases,
    attention_check,
    new_row_key_cases,
    tree_cases,
    unseen_slot_cases,
)
from hal.tools.conformance.error_checks import error_checks
from hal.tools.conformance.framework import (
    Check,
    CheckResult,
    ConformanceFailure,
    FeatureRow,
    Status,
    format_table,
    run_check,
    run_suite,
    summarize,
)
from hal.tools.conformance.graph_checks import LoopConfig, graph_checks, loop_configs
from hal.tools.conformance.pool_checks import pool_checks


def build_suite(*, quick: bool = False, select: Sequence[str] = ()) -> list[Check]:
    """Every check, in run order. ``quick`` trims the attention matrix and the loops (slow
    emulators); ``select`` keeps checks whose name or a feature contains any of the strings."""
    checks = (
        pool_checks()
        + [attention_check(c) for c in attention_cases(quick)]
        + [attention_check(c) for c in tree_cases(quick)]
        + [attention_check(c, poison_unseen=True) for c in unseen_slot_cases()]
        + [attention_check(c, poison_new_key=True) for c in new_row_key_cases()]
        + graph_checks(quick)
        + error_checks()
    )
    if select:
        wanted = [s.lower() for s in select]
        checks = [
            c for c in checks if any(w in c.name.lower() or any(w in f.lower() for f in c.features) for w in wanted)
        ]
    return checks


__all__ = [
    "ATTENTION_PROFILES",
    "Check",
    "CheckResult",
    "ConformanceFailure",
    "FeatureRow",
    "LoopConfig",
    "Status",
    "attention_cases",
    "build_suite",
    "format_table",
    "loop_configs",
    "run_check",
    "run_suite",
    "summarize",
    "tree_cases",
]
