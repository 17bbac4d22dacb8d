"""Run ``vllm.LLM`` on a checkpoint and print what it generated, as JSON on the line that starts with ``RESULT_MARK``.

The tests run it in a fresh process per engine (vLLM resolves its platform once per process), with
``HAL_VLLM_PLATFORM=1`` for hal and without it for vLLM's own CPU backend. Its one argument is a
JSON object: ``model``, ``dtype``, ``block_size``, ``rounds`` (lists of prompts, generated one round
after another so later rounds can hit the prefix cache), ``max_tokens``, and optional
``max_num_batched_tokens`` (chunked prefill), ``speculative_config``, ``max_model_len``, ``logprobs``
(how many of the most likely tokens to report at each generated position, as ``[token, logprob]`` pairs),
``module_files`` (vLLM modules to load from other source files first: a pinned file without hal's
patch, for a before/after test; the engine then runs in this process), ``time_attention`` (time the
attention backend's metadata builds and layer calls, hal's or CPU_ATTN's, during generation, from
round ``warmup_rounds`` on). The result gives each round's generation time (``round_s``) too.
"""

from __future__ import annotations

import json
import os
import sys
import time

#: The prefix of the line that carries the result (vLLM logs to the same stream).
RESULT_MARK = "ENGINE_RESULT "


def main(request: dict) -> dict:
    if request.get("module_files"):  # each named module executed from its file before vLLM imports it
        from hal.tools.testing import module_from_file

        for name, path in request["module_files"].items():
            module_from_file(name, path)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    hal_calls = {"forward": 0}
    hal_layers: set[str] = set()
    try:
        from hal.integrations.vllm.attention import HalAttentionImpl

        forward = HalAttentionImpl.forward

        def counted(self, layer, *args, **kwargs):  # type: ignore[no-untyped-def]
            hal_calls["forward"] += 1
            hal_layers.add(layer.layer_name)
            return forward(self, layer, *args, **kwargs)

        HalAttentionImpl.forward = counted  # type: ignore[method-assign]
    except ImportError:  # vLLM's own backend only: hal's adapter is not importable without hal
        pass
    npu_calls = {"FIA": 0, "SCATTER": 0}
    if os.environ.get("HAL_VLLM_EMULATE") == "1":  # count what hal's emulated Ascend runtime runs
        from hal.backends.npu import emulator

        ops = emulator.npu_runtime().torch_npu
        for attr, word in (("npu_fused_infer_attention_score_v2", "FIA"), ("npu_scatter_nd_update_", "SCATTER")):
            def count(*args, _op=getattr(ops, attr), _word=word, **kwargs):  # type: ignore[no-untyped-def]
                npu_calls[_word] += 1
                return _op(*args, **kwargs)

            setattr(ops, attr, count)
    options = dict(
        model=request["model"], skip_tokenizer_init=True, dtype=request.get("dtype", "float32"),
        max_model_len=request.get("max_model_len", 512), enforce_eager=True, block_size=request.get("block_size", 32),
        kv_cache_memory_bytes=request.get("kv_cache_memory_bytes", 64 << 20), seed=0, disable_log_stats=False,
    )
    if "max_num_batched_tokens" in request:
        options["max_num_batched_tokens"] = request["max_num_batched_tokens"]
        options["enable_chunked_prefill"] = True
    if request.get("attention_backend"):
        options["attention_backend"] = request["attention_backend"]
    if request.get("speculative_config"):
        options["speculative_config"] = request["speculative_config"]
    started = time.perf_counter()
    llm = LLM(**options)
    ready = time.perf_counter()
    attention_time = time_attention_backend() if request.get("time_attention") else None
    top = request.get("logprobs")
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0, ignore_eos=True, logprobs=top)
    rounds, likeliest, round_s = [], [], []
    for index, prompts in enumerate(request["rounds"]):
        if attention_time is not None and index == request.get("warmup_rounds", 0):  # timed from here on
            attention_time.update(dict.fromkeys(attention_time, 0))
        round_start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        round_s.append(time.perf_counter() - round_start)
        rounds.append([list(o.outputs[0].token_ids) for o in outputs])
        if top:
            likeliest.append([[sorted(([t, lp.logprob] for t, lp in position.items()), key=lambda pair: -pair[1])[:top]
                               for position in o.outputs[0].logprobs] for o in outputs])
    done = time.perf_counter()
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if hasattr(m, "value")}
    return {
        "tokens": rounds, "hal_forwards": hal_calls["forward"], "hal_layers": sorted(hal_layers), "start_s": ready - started, "generate_s": done - ready,
        "round_s": round_s,
        "prefix_cache_hits": metrics.get("vllm:prefix_cache_hits"), "spec_accepted": metrics.get("vllm:spec_decode_num_accepted_tokens"),
        "spec_drafts": metrics.get("vllm:spec_decode_num_drafts"), "likeliest": likeliest, "npu_calls": npu_calls,
        "attention_time": attention_time,
    }


def time_attention_backend() -> dict[str, float]:
    """Wrap the attention backend's ``build`` (per step) and layer calls with timers, hal's under
    hal's platform, CPU_ATTN's otherwise; the totals fill in as the engine runs. A layer call is the
    layer's ``forward`` and, for CPU_ATTN, its K/V write (vLLM calls ``do_kv_cache_update`` apart
    from ``forward``; hal's ``forward`` writes as it attends). Layer calls are counted apart for
    decode steps (one query row per request) and the others (prefills, mixed steps), by the step the
    last build was for; in decode steps the first layer call after a build is also counted apart
    from the later ones, and the kernel inside a call: hal's compiled call
    (``PreparedAttention.__call__``), CPU_ATTN's attention and K/V-write ops."""
    from vllm import _custom_ops as ops

    if os.environ.get("HAL_VLLM_PLATFORM") == "1":
        from hal.backends.cpu.native import PreparedAttention
        from hal.integrations.vllm.attention import HalAttentionImpl as Impl
        from hal.integrations.vllm.attention import HalMetadataBuilder as Builder
        kernels = [(PreparedAttention, "__call__")]
    else:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder as Builder
        kernels = [(ops, "cpu_attention_with_kv_cache"), (ops, "cpu_attn_reshape_and_cache")]
    totals = {"build_s": 0.0, "builds": 0, "decode_forward_s": 0.0, "decode_forwards": 0, "other_forward_s": 0.0,
              "other_forwards": 0, "decode_first_layer_s": 0.0, "decode_first_layers": 0, "decode_later_layer_s": 0.0,
              "decode_later_layers": 0, "decode_kernel_s": 0.0}
    step = {"kind": "other", "layer": 0}

    def timed(owner, name, account):  # type: ignore[no-untyped-def]
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                account(time.perf_counter() - start)
        setattr(owner, name, wrapper)

    def layer_call(seconds: float, count: bool = True) -> None:
        kind = step["kind"]
        totals[f"{kind}_forward_s"] += seconds
        totals[f"{kind}_forwards"] += count
        if kind == "decode":
            position = "first" if step["layer"] == 0 else "later"
            totals[f"decode_{position}_layer_s"] += seconds
            totals[f"decode_{position}_layers"] += count
            step["layer"] += count

    def kernel(seconds: float) -> None:
        if step["kind"] == "decode":
            totals["decode_kernel_s"] += seconds

    build = Builder.build

    def timed_build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        totals["build_s"] += time.perf_counter() - start
        totals["builds"] += 1
        decode = common_attn_metadata.num_actual_tokens == common_attn_metadata.num_reqs
        step.update(kind="decode" if decode else "other", layer=0)
        return result

    Builder.build = timed_build
    if "do_kv_cache_update" in vars(Impl):  # CPU_ATTN: the write half of its layer call, counted before the forward
        timed(Impl, "do_kv_cache_update", lambda seconds: layer_call(seconds, count=False))
    timed(Impl, "forward", layer_call)
    for owner, name in kernels:
        timed(owner, name, kernel)
    return totals


if __name__ == "__main__":
    print(RESULT_MARK + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
