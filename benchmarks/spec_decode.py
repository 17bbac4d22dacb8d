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

from speculative import demo
from speculative.distill import DistillConfig, distill
from speculative.model import TinyConfig, TinyMiMo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    demo.add_arguments(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8], help="batch sizes to compare")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each decoder per batch size")
    parser.set_defaults(max_new_tokens=192)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = TinyMiMo(TinyConfig(seed=args.seed, num_mtp_layers=args.num_steps))
    report = distill(model, DistillConfig(steps=args.train_steps, num_sequences=args.train_sequences), use_cache=not args.no_cache)
    largest = max(args.batch_sizes)
    plain, spec, kv_dtype = demo.build_engines(
        model,
        args.device,
        args.num_steps,
        args.kv_dtype,
        emulate=args.emulate,
        page_size=args.page_size,
        max_batch_size=largest,
        max_seq_len=16 + 3 * largest + args.max_new_tokens + args.num_steps + 1,
    )
    print(
        f"backend {spec.backend_name}, KV {str(kv_dtype).replace('torch.', '')}, pages of {args.page_size}, "
        f"S={args.num_steps}, {args.max_new_tokens} new tokens per request, {args.repeats} alternating runs, "
        f"torch threads {torch.get_num_threads()}, MTP {'cached' if report.from_cache else 'trained'}"
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
