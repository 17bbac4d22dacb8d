"""hal against vLLM's own CPU attention backend inside ``vllm.LLM``: generation time side by side,
alternating runs, same tokens required. Run in the vLLM environment (``bash .ci/vllm`` builds it):

    .venv-vllm/bin/python benchmarks/vllm_speed.py [--prompt-lens 64 896] [--new-tokens 64] [--repeats 3]

A random Qwen3 checkpoint (2 layers, 4 query / 2 KV heads of 32) saved by transformers; 4 prompts of
64 and of 896 tokens, 64 new tokens each, greedy. Prints hal's speed over CPU_ATTN's (> 1: hal is
faster): the median of the repeats and their range.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations" / "vllm"))

from conftest import run_engine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 896])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch
    import transformers

    directory = Path(tempfile.mkdtemp()) / "qwen3"
    torch.manual_seed(1)
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, initializer_range=0.3, max_position_embeddings=1024)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)
    rng = random.Random(0)
    print("| prompt | batch | hal / CPU_ATTN speed, median (range) | same tokens |\n|---|---|---|---|")
    all_same = True
    for length in args.prompt_lens:
        prompts = [[rng.randrange(256) for _ in range(length)] for _ in range(4)]
        request = {"model": str(directory), "rounds": [prompts], "max_tokens": args.new_tokens, "max_model_len": 1024}
        ratios, same = [], True
        for _ in range(args.repeats):
            ours, theirs = run_engine(request, hal=True), run_engine(request, hal=False)
            same &= ours["tokens"] == theirs["tokens"]
            ratios.append(theirs["generate_s"] / ours["generate_s"])
        print(f"| {length} | 4 | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {same} |")
        all_same &= same
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
