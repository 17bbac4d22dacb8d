"""hal against vLLM's own CPU attention backend inside ``vllm.LLM``: generation time side by side,
alternating runs, same tokens required, and where each backend's attention time goes. Run in the
vLLM environment (``bash .ci/vllm`` builds it):

    .venv-vllm/bin/python benchmarks/vllm_speed.py [--models small gqa8] [--prompt-lens 64 896] [--new-tokens 64] [--repeats 3] [--rounds 4]

Random Qwen3 checkpoints saved by transformers, 2 layers each: ``small`` (4 query / 2 KV heads of
32) and ``gqa8`` (16 query / 2 KV heads of 128: 8:1 GQA at head dim 128); rounds of 4 fresh prompts
of each length, 64 new tokens each, greedy. Each engine run generates a warm-up round (its first
steps load and prepare what later ones reuse), then ``--rounds`` timed ones; the two backends' runs
alternate, which goes first changing from repeat to repeat. Prints hal's speed over CPU_ATTN's (> 1:
hal is faster: CPU_ATTN's timed rounds' time over hal's), the median over the repeats and their
range, and each backend's attention time inside the engine over its last repeat's timed rounds: the
metadata build per step (vLLM's builder) and one layer's call (KV write and attention: CPU_ATTN's
write is a call of its own, counted in), averaged apart over decode steps and over the other steps
(the prefill); then, over the decode steps, the first layer call after a build apart from the later
ones, and the kernel inside a call (hal's compiled call, CPU_ATTN's attention and K/V-write ops).

    .venv-vllm/bin/python benchmarks/vllm_speed.py --attention-step [--models small gqa8] [--kv-lens 64 896] [--threads 1 2]

The attention backends alone, outside the engine, one process: vLLM's ``Attention`` layers built
with each backend over caches of vLLM's layout, each step's metadata from the backend's own vLLM
builder over one ``CommonAttentionMetadata``, then the layers' calls; a decode step (4 requests, one
new token each) and a mixed step (two decode rows, two requests extending by a 16-token chunk),
after a prefill that writes each backend's history through its own path. Prints each backend's
build and layer time per step, hal's speed over CPU_ATTN's per step (median and range over
alternating blocks of steps) and the largest output difference.
"""

from __future__ import annotations

import itertools
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


def decode_split_cells(timing: dict[str, Any]) -> str:
    """``build ms | first layer call ms | later layer call ms | kernel ms per layer call`` over one
    engine run's decode steps (``attention_time``; the kernel: hal's compiled call, CPU_ATTN's ops)."""
    def per(total: str, count: str) -> str:
        return f"{timing[total] / max(timing[count], 1) * 1e3:.3f}"
    return " | ".join([per("build_s", "builds"), per("decode_first_layer_s", "decode_first_layers"),
                       per("decode_later_layer_s", "decode_later_layers"), per("decode_kernel_s", "decode_forwards")])


#: tokens a block holds in the attention-step benchmark (the engine runs' block size)
STEP_BLOCK = 32
#: (decode rows, chunk rows) of the attention-step benchmark's steps: 4 decode rows; 2 and 2 chunks of 16
STEPS = {"decode": (1, 1, 1, 1), "mixed": (1, 1, 16, 16)}


def bench_attention_step(args: Any) -> int:
    """hal's and CPU_ATTN's builder and layers on the same steps (see the module doc)."""
    import time

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from hal.integrations.vllm.attention import HalAttentionBackend

    backends = {"hal": HalAttentionBackend, "CPU_ATTN": CPUAttentionBackend}
    directory = Path(tempfile.mkdtemp())
    gen = torch.Generator().manual_seed(0)
    layer_count, batch = 4, 4
    print(f"batch {batch}, {layer_count} layers, blocks of {STEP_BLOCK} tokens, medians of {args.repeats} alternating blocks "
          f"of 50 steps; speed = CPU_ATTN time / hal time per step (> 1: hal is faster)")
    print("| model | threads | kv length | step | hal build ms | hal layers ms | CPU_ATTN build ms | CPU_ATTN layers ms "
          "| hal / CPU_ATTN speed, median (range) |\n|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for name in args.models:
        q_heads, kv_heads, head_dim, _ = MODELS[name]
        model = checkpoint(name, directory)
        config = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024, enforce_eager=True,
                            block_size=STEP_BLOCK).create_engine_config()
        for history in args.kv_lens:
            per_request = -(-(history + max(max(rows) for rows in STEPS.values())) // STEP_BLOCK)
            blocks = 1 + batch * per_request  # block 0: vLLM's null block
            table = (1 + torch.arange(batch * per_request, dtype=torch.int32)).view(batch, per_request)
            built: dict[str, tuple[Any, list[Any]]] = {}
            with set_current_vllm_config(config):
                for label, backend in backends.items():
                    layers = [Attention(q_heads, head_dim, head_dim**-0.5, kv_heads, prefix=f"{label}.{name}.{history}.{i}.attn",
                                        attn_backend=backend) for i in range(layer_count)]
                    for layer in layers:
                        layer.kv_cache = torch.zeros(blocks, kv_heads, STEP_BLOCK, 2 * head_dim)
                    spec = layers[0].get_kv_cache_spec(config)
                    builder = backend.get_builder_cls()(spec, [layer.layer_name for layer in layers], config, torch.device("cpu"))
                    built[label] = (builder, layers)

            def common(q_lens: list[int], kv_lens: list[int]) -> Any:
                starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
                positions = [p for q, kv in zip(q_lens, kv_lens) for p in range(kv - q, kv)]
                slots = torch.tensor([int(table[r, p // STEP_BLOCK]) * STEP_BLOCK + p % STEP_BLOCK
                                      for r, (q, kv) in enumerate(zip(q_lens, kv_lens)) for p in range(kv - q, kv)])
                return CommonAttentionMetadata(
                    query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
                    num_reqs=batch, num_actual_tokens=len(positions), max_query_len=max(q_lens), max_seq_len=max(kv_lens),
                    block_table_tensor=table, slot_mapping=slots, causal=True,
                )

            def rows(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                return (torch.randn(tokens, q_heads, head_dim, generator=gen), torch.randn(tokens, kv_heads, head_dim, generator=gen),
                        torch.randn(tokens, kv_heads, head_dim, generator=gen))

            def step(label: str, cm: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float, torch.Tensor]:
                builder, layers = built[label]
                begin = time.perf_counter()
                metadata = builder.build(0, cm)
                middle = time.perf_counter()
                outputs = torch.empty(layer_count, q.shape[0], q_heads * head_dim)
                for layer, output in zip(layers, outputs):
                    if not backends[label].forward_includes_kv_cache_update:  # CPU_ATTN: vLLM writes the K/V first
                        layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, cm.slot_mapping)
                    layer.impl.forward(layer, q, k, v, layer.kv_cache, metadata, output)
                return middle - begin, time.perf_counter() - middle, outputs

            prefill, prompt_rows = common([history] * batch, [history] * batch), rows(batch * history)
            worst = max(worst, float((step("hal", prefill, *prompt_rows)[2] - step("CPU_ATTN", prefill, *prompt_rows)[2]).abs().max()))
            for step_name, q_lens in STEPS.items():
                cm = common(list(q_lens), [history + q for q in q_lens])
                new_rows = rows(sum(q_lens))
                worst = max(worst, float((step("hal", cm, *new_rows)[2] - step("CPU_ATTN", cm, *new_rows)[2]).abs().max()))
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    times: dict[str, list[tuple[float, float]]] = {label: [] for label in backends}
                    for i in range(args.repeats):
                        for label in backends if i % 2 == 0 else reversed(list(backends)):
                            parts = [step(label, cm, *new_rows)[:2] for _ in range(50)]
                            times[label].append((sum(b for b, _ in parts) / 50, sum(c for _, c in parts) / 50))
                    ratios = [sum(c) / sum(h) for h, c in zip(times["hal"], times["CPU_ATTN"])]
                    cells = " | ".join(f"{statistics.median(t[j] for t in times[label]) * 1e3:.3f}" for label in backends for j in (0, 1))
                    print(f"| {name} | {threads} | {history} | {step_name} | {cells} | {statistics.median(ratios):.2f} "
                          f"({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)
    print(f"largest output difference between the backends: {worst:.2e}")
    return 0 if worst < 1e-4 else 1


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["small", "gqa8"])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 896])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per engine run, after one warm-up round")
    parser.add_argument("--attention-step", action="store_true", help="the attention backends alone, outside the engine")
    parser.add_argument("--kv-lens", type=int, nargs="+", default=[64, 896], help="with --attention-step: the history per request")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="with --attention-step: torch threads")
    args = parser.parse_args(argv)
    if args.attention_step:
        return bench_attention_step(args)

    directory = Path(tempfile.mkdtemp())
    rng = random.Random(0)
    print("| model | prompt | batch | hal / CPU_ATTN speed, median (range) | hal build ms/step | hal layer call ms, decode "
          "| hal layer call ms, prefill | CPU_ATTN build ms/step | CPU_ATTN layer call ms, decode | CPU_ATTN layer call ms, "
          "prefill | same tokens |\n|---|---|---|---|---|---|---|---|---|---|---|")
    all_same, splits = True, []
    for name in args.models:
        model = checkpoint(name, directory)
        for length in args.prompt_lens:
            rounds = [[[rng.randrange(256) for _ in range(length)] for _ in range(4)] for _ in range(1 + args.rounds)]
            request = {"model": str(model), "rounds": rounds, "max_tokens": args.new_tokens, "max_model_len": 1024,
                       "time_attention": True, "warmup_rounds": 1}
            ratios, same = [], True
            for repeat in range(args.repeats):
                runs = {hal: run_engine(request, hal=hal) for hal in ((True, False) if repeat % 2 == 0 else (False, True))}
                ours, theirs = runs[True], runs[False]
                same &= ours["tokens"] == theirs["tokens"]
                ratios.append(sum(theirs["round_s"][1:]) / sum(ours["round_s"][1:]))
            print(f"| {name} | {length} | 4 | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                  f"{attention_cells(ours['attention_time'])} | {attention_cells(theirs['attention_time'])} | {same} |", flush=True)
            all_same &= same
            splits.append(f"| {name} | {length} | {decode_split_cells(ours['attention_time'])} | "
                          f"{decode_split_cells(theirs['attention_time'])} |")
    print("\nDecode steps of the last repeat, per step: the build, the first layer call after it and a later one "
          "(K/V write included), and the kernel inside a layer call (hal: the compiled call; CPU_ATTN: its attention "
          "and K/V-write ops), ms\n\n| model | prompt | hal build | hal first layer | hal later layer | hal kernel "
          "| CPU_ATTN build | CPU_ATTN first layer | CPU_ATTN later layer | CPU_ATTN kernel |\n|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(splits), flush=True)
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
