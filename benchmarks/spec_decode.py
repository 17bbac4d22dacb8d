"""Speculative decoding benchmark: plain greedy vs multi-layer EAGLE (MTP) on one backend, one run.

    python benchmarks/spec_decode.py [--device cpu] [--emulate] [--max-new-tokens 256] [--repeats 3]

Prints the median tokens/s of each, the speedup ratio and the mean accept length; exits 1 if the
outputs differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from speculative import demo
from speculative.distill import DistillConfig, distill
from speculative.model import TinyConfig, TinyMiMo
from speculative.worker import GreedyDecoder, MultiLayerEagleWorker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    demo.add_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each decoder (median reported)")
    parser.set_defaults(max_new_tokens=256, batch_size=8)
    args = parser.parse_args(argv)
    model = TinyMiMo(TinyConfig(seed=args.seed, num_mtp_layers=args.num_steps))
    distill(model, DistillConfig(steps=args.train_steps), use_cache=not args.no_cache)
    engine_args = dict(
        emulate=args.emulate,
        page_size=args.page_size,
        kv_dtype=demo.KV_DTYPES[args.kv_dtype],
        max_batch_size=args.batch_size,
        max_seq_len=16 + 3 * args.batch_size + args.max_new_tokens + args.num_steps + 1,
    )
    plain = GreedyDecoder(model, args.device, **engine_args)
    spec = MultiLayerEagleWorker(model, args.device, num_steps=args.num_steps, **engine_args)
    prompts = demo.make_prompts(args.batch_size, model.config.vocab_size, args.seed)
    plain.generate(prompts[:1], 2)
    spec.generate(prompts[:1], 2)
    base = [plain.generate(prompts, args.max_new_tokens) for _ in range(args.repeats)]
    fast = [spec.generate(prompts, args.max_new_tokens) for _ in range(args.repeats)]
    base_tps = statistics.median(r.tokens_per_second for r in base)
    fast_tps = statistics.median(r.tokens_per_second for r in fast)
    identical = all(r.tokens == base[0].tokens for r in base + fast)
    print(f"backend {spec.backend_name}, batch {args.batch_size}, {args.max_new_tokens} new tokens, S={args.num_steps}")
    print("| decoder | tokens/s (median) | target forwards | accept length |")
    print("|---|---|---|---|")
    print(f"| plain greedy | {base_tps:.1f} | {base[0].target_forwards} | - |")
    print(f"| MTP | {fast_tps:.1f} | {fast[0].target_forwards} | {fast[0].mean_accept_length:.2f} |")
    print(f"speedup {fast_tps / base_tps:.2f}x, outputs identical: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
