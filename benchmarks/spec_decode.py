"""Speculative decoding benchmark: plain greedy vs multi-layer EAGLE (MTP) on one backend, one run.

    python benchmarks/spec_decode.py [--device cpu] [--emulate] [--max-new-tokens 192]
                                     [--batch-sizes 1 4 8] [--repeats 5]

For each batch size, the two decoders run alternately ``--repeats`` times on the same prompts
(so machine load hits both alike); the table gives median tokens/s, the speedup ratio of the
medians, the mean accept length and target forwards. Exits 1 if any output differs from plain
greedy's.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from hal.tools import demo
from hal.tools.cli import add_demo_options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_demo_options(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8], help="batch sizes to compare")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each decoder per batch size")
    parser.set_defaults(max_new_tokens=192)
    args = parser.parse_args(argv)
    built = demo.setup(args, max(args.batch_sizes))
    model, plain, spec = built.model, built.plain, built.spec
    pool = spec.target_pool.spec
    print(
        f"backend {spec.backend_name}, KV {str(pool.dtype).replace('torch.', '')}, pages of {pool.page_size}, "
        f"S={args.num_steps}, {args.max_new_tokens} new tokens per request, {args.repeats} alternating runs, "
        f"torch threads {torch.get_num_threads()}, MTP {'cached' if built.report.from_cache else 'trained'}"
    )
    print("| batch | plain greedy tok/s | MTP tok/s | speedup | accept length | target forwards (plain / MTP) |")
    print("|---|---|---|---|---|---|")
    all_identical = True
    for batch in args.batch_sizes:
        prompts = demo.make_prompts(batch, model.config.vocab_size, args.seed)
        plain.generate(prompts[:1], 2)  # warm-up, untimed
        spec.generate(prompts[:1], 2)
        base, fast = [], []
        for _ in range(args.repeats):
            base.append(plain.generate(prompts, args.max_new_tokens))
            fast.append(spec.generate(prompts, args.max_new_tokens))
        identical = all(r.tokens == base[0].tokens for r in base + fast)
        all_identical &= identical
        base_tps = statistics.median(r.tokens_per_second for r in base)
        fast_tps = statistics.median(r.tokens_per_second for r in fast)
        print(
            f"| {batch} | {base_tps:.1f} | {fast_tps:.1f} | {fast_tps / base_tps:.2f}x | "
            f"{fast[0].mean_accept_length:.2f} of {args.num_steps + 1} | "
            f"{base[0].target_forwards} / {fast[0].target_forwards} |" + ("" if identical else " OUTPUTS DIFFER")
        )
    print(f"outputs identical to plain greedy: {'yes' if all_identical else 'NO'}")
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
