"""hal against vLLM's own CPU attention backend inside ``vllm.LLM``: generation time side by side,
alternating runs, same tokens required, and where each backend's attention time goes. Run in the
vLLM environment (``bash .ci/vllm`` builds it):

    .venv-vllm/bin/python benchmarks/vllm_speed.py [--models small gqa8] [--prompt-lens 64 896] [--new-tokens 64] [--repeats 3]

Random Qwen3 checkpoints saved by transformers, 2 layers each: ``small`` (4 query / 2 KV heads of
32) and ``gqa8`` (16 query / 2 KV heads of 128: 8:1 GQA at head dim 128); 4 prompts of each length,
64 new tokens each, greedy. Prints hal's speed over CPU_ATTN's (> 1: hal is faster), the median of
the repeats and their range, and each backend's attention time inside the engine, from its last
repeat: the metadata build per step (vLLM's builder) and one layer's call (KV write and attention),
averaged apart over decode steps and over the other steps (the prefill).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations" / "vllm"))

from conftest import run_engine  # noqa: E402

#: name -> (query heads, KV heads, head dim, hidden size)
MODELS = {"small": (4, 2, 32, 128), "gqa8": (16, 2, 128, 256)}


def checkpoint(name: str, directory: Path) -> Path:
    import torch
    import transformers

    q_heads, kv_heads, head_dim, hidden = MODELS[name]
    torch.manual_seed(1)
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                      initializer_range=0.3, max_position_embeddings=1024)
    path = directory / name
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def attention_cells(timing: dict[str, Any]) -> str:
    """``build ms/step | decode-step layer call ms | prefill-step layer call ms`` from one engine
    run's ``attention_time``."""
    build = timing["build_s"] / max(timing["builds"], 1) * 1e3
    decode = timing["decode_forward_s"] / max(timing["decode_forwards"], 1) * 1e3
    other = timing["other_forward_s"] / max(timing["other_forwards"], 1) * 1e3
    return f"{build:.3f} | {decode:.3f} | {other:.2f}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["small", "gqa8"])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 896])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    directory = Path(tempfile.mkdtemp())
    rng = random.Random(0)
    print("| model | prompt | batch | hal / CPU_ATTN speed, median (range) | hal build ms/step | hal layer call ms, decode "
          "| hal layer call ms, prefill | CPU_ATTN build ms/step | CPU_ATTN layer call ms, decode | CPU_ATTN layer call ms, "
          "prefill | same tokens |\n|---|---|---|---|---|---|---|---|---|---|---|")
    all_same = True
    for name in args.models:
        model = checkpoint(name, directory)
        for length in args.prompt_lens:
            prompts = [[rng.randrange(256) for _ in range(length)] for _ in range(4)]
            request = {"model": str(model), "rounds": [prompts], "max_tokens": args.new_tokens, "max_model_len": 1024,
                       "time_attention": True}
            ratios, same = [], True
            for _ in range(args.repeats):
                ours, theirs = run_engine(request, hal=True), run_engine(request, hal=False)
                same &= ours["tokens"] == theirs["tokens"]
                ratios.append(theirs["generate_s"] / ours["generate_s"])
            print(f"| {name} | {length} | 4 | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                  f"{attention_cells(ours['attention_time'])} | {attention_cells(theirs['attention_time'])} | {same} |", flush=True)
            all_same &= same
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
