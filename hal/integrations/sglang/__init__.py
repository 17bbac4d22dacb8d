"""hal inside SGLang, through SGLang's plugin entry points (see ``pyproject.toml``).

- ``plugin.register`` (group ``sglang.srt.plugins``) adds the attention backend ``hal``:
  ``--attention-backend hal`` runs the attention kernel of hal's backend for SGLang's device over
  hal's split K/V pool.
- ``plugin.activate_platform`` (group ``sglang.srt.platforms``) names ``platform.HalPlatform``
  only when ``SGLANG_PLATFORM=hal``: installing hal never changes which platform SGLang picks.

Importing this package imports nothing from SGLang; its modules import SGLang when SGLang loads
them. The SGLang internals they touch are listed in ``SGLANG_INTERNALS``.
"""

from __future__ import annotations

#: The SGLang version these adapters are tested against (``.ci/sglang``).
TESTED_SGLANG_VERSION = "0.5.23"

#: Every SGLang name the adapters read, call, subclass or patch, by file (SGLang 0.5.23), so an
#: upgrade knows what to re-check.
SGLANG_INTERNALS: dict[str, tuple[str, ...]] = {
    "sglang/srt/layers/attention/attention_registry.py": ("register_attention_backend",),
    "sglang/srt/arg_groups/choices.py": ("ATTENTION_BACKEND_CHOICES", "add_attention_backend_choices"),
    "sglang/srt/layers/attention/base_attn_backend.py": (
        "AttentionBackend: init_forward_metadata, init_cuda_graph_state, init_forward_metadata_out_graph, "
        "init_forward_metadata_in_graph, get_cuda_graph_seq_len_fill_value, forward_extend, forward_decode",
    ),
    "sglang/srt/model_executor/forward_batch_info.py": (
        "ForwardMode: EXTEND, DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2, IDLE, MIXED",
        "ForwardBatch: forward_mode, batch_size, req_pool_indices, seq_lens, seq_lens_cpu, extend_seq_lens_cpu, "
        "extend_prefix_lens_cpu, out_cache_loc, spec_info",
    ),
    "sglang/srt/speculative/spec_info.py": ("SpecInput.num_tokens_per_req", "SpecInput.draft_token_num", "SpecInput.topk"),
    "sglang/srt/layers/radix_attention.py": (
        "RadixAttention: layer_id, tp_q_head_num, tp_k_head_num, qk_head_dim, v_head_dim, scaling, "
        "sliding_window_size, logit_cap, is_cross_attention, attn_type",
    ),
    "sglang/srt/model_executor/model_runner.py": (
        "ModelRunner: device, gpu_id, req_to_token_pool.req_to_token, token_to_kv_pool, model_config.context_len",
    ),
    "sglang/srt/mem_cache/memory_pool.py": (
        "MHATokenToKVPool: __init__ keyword arguments, _create_buffers, _build_kv_buffer_descs, "
        "_init_data_ptrs_and_strides, k_buffer, v_buffer, size, page_size, head_num, head_dim, v_head_dim, "
        "layer_num, start_layer, dtype, store_dtype, device, kv_cache_layout, is_quantized_kv_cache, post_capture_active",
    ),
    "sglang/srt/platforms/interface.py": (
        "SRTPlatform: get_kv_pool_cls(kind=), get_default_attention_backend, "
        "get_default_speculative_draft_attention_backend, supports_speculative_draft_attention_backend, "
        "get_full_graph_backend_cls, get_speculative_graph_runner_cls(algorithm, phase), capabilities",
        "PlatformCapabilities(supports_triton, graph_capture)",
    ),
    "sglang/srt/platforms/device_mixin.py": ("DeviceMixin.is_out_of_tree (overridden: True)",),
    "sglang/srt/platforms/cpu.py, cuda.py, npu.py": ("CpuSRTPlatform, CudaSRTPlatform, NPUSRTPlatform (HalPlatform's base)",),
    "sglang/srt/arg_groups/platform_hook.py": (
        "handle_cpu_backends sets the CPU attention default before handle_platform_defaults runs",
    ),
    "sglang/srt/model_executor/runner_backend/base_cuda_graph_backend.py": (
        "BaseCudaGraphBackend: capture_session, capture_one, can_run, replay_session, replay, cleanup; "
        "the runner's model_runner.device and attn_backend",
    ),
    "sglang/srt/speculative/multi_layer_eagle_draft_extend_cuda_graph_runner.py": (
        "MultiLayerEagleMultiStepDraftExtendCudaGraphRunner (HalMultiLayerEagleDraftExtendRunner's base)",
    ),
    "sglang/srt/platforms/__init__.py": ("_resolve_platform (SGLANG_PLATFORM; an activate() returning None is skipped)",),
    "sglang/srt/plugins/__init__.py": ("entry-point groups sglang.srt.plugins, sglang.srt.platforms",),
    "sglang/srt/speculative/multi_layer_eagle_worker_v2.py": (
        "MultiLayerEagleDraftWorker._capture_cuda_graphs: the _is_npu runner choice (patches/)",
    ),
}
