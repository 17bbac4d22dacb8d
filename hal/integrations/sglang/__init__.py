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

import json
from pathlib import Path

#: The SGLang version these adapters are tested against (``.ci/sglang``).
TESTED_SGLANG_VERSION = "0.5.23"

#: Every SGLang name the adapters read, call, subclass or patch, by module (SGLang 0.5.23), so an
#: upgrade knows what to re-check. ``Class.member`` names a method, class attribute, dataclass
#: field or instance attribute; ``tests/integrations/sglang/test_plugin.py`` checks each still exists.
SGLANG_INTERNALS: dict[str, tuple[str, ...]] = {
    "sglang.srt.plugins": ("PLATFORM_PLUGINS_GROUP", "GENERAL_PLUGINS_GROUP"),
    "sglang.srt.arg_groups.choices": ("ATTENTION_BACKEND_CHOICES", "add_attention_backend_choices"),
    "sglang.srt.arg_groups.platform_hook": ("handle_cpu_backends", "handle_platform_defaults"),
    "sglang.srt.layers.attention.attention_registry": ("register_attention_backend", "ATTENTION_BACKENDS"),
    "sglang.srt.layers.attention.base_attn_backend": (
        "AttentionBackend.init_forward_metadata", "AttentionBackend.init_cuda_graph_state",
        "AttentionBackend.init_forward_metadata_out_graph", "AttentionBackend.init_forward_metadata_in_graph",
        "AttentionBackend.get_cuda_graph_seq_len_fill_value", "AttentionBackend.forward_extend",
        "AttentionBackend.forward_decode", "AttentionBackend.forward_metadata",
    ),
    "sglang.srt.model_executor.forward_batch_info": (
        "ForwardMode.EXTEND", "ForwardMode.DECODE", "ForwardMode.TARGET_VERIFY", "ForwardMode.DRAFT_EXTEND_V2",
        "ForwardMode.is_idle", "ForwardBatch.forward_mode", "ForwardBatch.batch_size", "ForwardBatch.req_pool_indices",
        "ForwardBatch.seq_lens", "ForwardBatch.seq_lens_cpu", "ForwardBatch.extend_seq_lens_cpu",
        "ForwardBatch.extend_prefix_lens_cpu", "ForwardBatch.out_cache_loc", "ForwardBatch.spec_info",
    ),
    "sglang.srt.speculative.spec_info": ("SpecInput.num_tokens_per_req", "SpecInput.spec_input_type", "SpecInputType.NGRAM_VERIFY"),
    "sglang.srt.speculative.eagle_info": ("EagleVerifyInput.tree_topk", "EagleVerifyInput.topk", "EagleVerifyInput.custom_mask"),
    "sglang.srt.speculative.ngram_info": ("NgramVerifyInput.tree_topk", "NgramVerifyInput.custom_mask"),
    # The resolved speculative configuration: speculative_eagle_topk, enable_multi_layer_eagle.
    "sglang.srt.runtime_context": ("get_spec",),
    # The refusal at server-argument time: a hook after resolution, read through SGLang's view.
    "sglang.srt.plugins.hook_registry": ("HookRegistry.register", "HookType.AFTER"),
    "sglang.srt.server_args": ("ServerArgs.resolve_once",),
    "sglang.srt.arg_groups.model_override_base": ("resolving_view",),
    "sglang.srt.layers.radix_attention": (
        "AttentionType.ENCODER_ONLY", "RadixAttention.layer_id", "RadixAttention.tp_q_head_num",
        "RadixAttention.tp_k_head_num", "RadixAttention.qk_head_dim", "RadixAttention.v_head_dim",
        "RadixAttention.scaling", "RadixAttention.sliding_window_size", "RadixAttention.logit_cap",
        "RadixAttention.is_cross_attention", "RadixAttention.attn_type",
    ),
    "sglang.srt.model_executor.model_runner": (
        "ModelRunner.device", "ModelRunner.req_to_token_pool", "ModelRunner.token_to_kv_pool", "ModelRunner.model_config",
        "ModelRunner.sliding_window_size",
    ),
    "sglang.srt.mem_cache.swa_memory_pool": (
        "SWAKVPool.full_kv_pool", "SWAKVPool.swa_kv_pool", "SWAKVPool.layers_mapping", "SWAKVPool.full_to_swa_index_mapping",
        "SWAKVPool.swa_req_ring_size", "SWAKVPool.layer_num", "SWAKVPool.page_size", "SWAKVPool.start_layer",
    ),
    "sglang.srt.mem_cache.unified_memory_pool": ("UnifiedSWAKVPool",),
    "sglang.srt.mem_cache.memory_pool": (
        "ReqToTokenPool.req_to_token", "MHATokenToKVPool._create_buffers", "MHATokenToKVPool._build_kv_buffer_descs",
        "MHATokenToKVPool._init_data_ptrs_and_strides", "MHATokenToKVPool.k_buffer", "MHATokenToKVPool.v_buffer",
        "MHATokenToKVPool.head_num", "MHATokenToKVPool.head_dim", "MHATokenToKVPool.v_head_dim",
        "MHATokenToKVPool.kv_cache_layout", "MHATokenToKVPool.is_quantized_kv_cache", "MHATokenToKVPool.post_capture_active",
        "KVCache.size", "KVCache.page_size", "KVCache.layer_num", "KVCache.start_layer", "KVCache.dtype",
        "KVCache.store_dtype", "KVCache.device",
    ),
    "sglang.srt.platforms.interface": (
        "SRTPlatform.get_kv_pool_cls", "SRTPlatform.get_default_attention_backend",
        "SRTPlatform.get_default_speculative_draft_attention_backend",
        "SRTPlatform.supports_speculative_draft_attention_backend", "SRTPlatform.get_full_graph_backend_cls",
        "SRTPlatform.get_speculative_graph_runner_cls", "SRTPlatform.capabilities", "SRTPlatform.supports_speculative_algorithm",
        "PlatformCapabilities.supports_triton", "PlatformCapabilities.graph_capture",
    ),
    "sglang.srt.platforms.device_mixin": ("DeviceMixin.is_out_of_tree", "DeviceMixin.empty_cache", "DeviceMixin.synchronize"),
    "sglang.srt.platforms": ("_resolve_platform", "current_platform"),
    # Patched (patches/): the draft-extend and multi-step draft-decode tables ask the platform; the MTP model syncs through it.
    "sglang.srt.speculative.draft_utils": (
        "DraftBackendFactory._create_backend", "DraftBackendFactory.create_draft_extend_backend",
        "DraftBackendFactory.create_decode_backend",
    ),
    # Where EAGLE's draft decode puts each branch's draft tokens (hal's draft_branch_rows follows it),
    # and how its worker reaches the per-step backends (attn_backends[i]).
    "sglang.srt.speculative.eagle_worker_common": ("prepare_for_draft", "duplicate_prefix_tail_to_draft_branches"),
    "sglang.srt.speculative.eagle_utils": ("per_step_draft_out_cache_loc",),
    "sglang.srt.models.mimo_v2_nextn": ("MiMoV2MTP.set_embed_and_head",),
    "sglang.srt.mem_cache.base_swa_memory_pool": ("BaseSWAKVPool.swa_req_ring_size", "BaseSWAKVPool.register_mapping"),
    "sglang.srt.platforms.cpu": ("CpuSRTPlatform",),
    "sglang.srt.platforms.cuda": ("CudaSRTPlatform",),
    "sglang.srt.platforms.npu": ("NPUSRTPlatform",),
    "sglang.srt.model_executor.runner_backend.base_cuda_graph_backend": (
        "BaseCudaGraphBackend.capture_session", "BaseCudaGraphBackend.capture_one", "BaseCudaGraphBackend.can_run",
        "BaseCudaGraphBackend.replay_session", "BaseCudaGraphBackend.replay", "BaseCudaGraphBackend.cleanup",
    ),
    "sglang.srt.speculative.multi_layer_eagle_draft_extend_cuda_graph_runner": (
        "MultiLayerEagleMultiStepDraftExtendCudaGraphRunner",
    ),
    "sglang.srt.speculative.multi_layer_eagle_worker_v2": (
        "MultiLayerEagleDraftWorker._capture_cuda_graphs",  # its _is_npu runner choice: patches/
    ),
}


def mimo_rope_override(model: str | Path) -> str:
    """The ``json_model_override_args`` SGLang 0.5.23 needs to load a MiMo-V2-Flash checkpoint in
    the published config form on a CPU: its ``models/mimo_v2.py`` hands transformers' per-layer-type
    rope dicts to ``get_rope``, whose cache cannot hash them. A flat ``rope_parameters`` gets past
    it; full layers then take ``rope_theta`` and sliding-window layers ``swa_rope_theta``."""
    config = json.loads((Path(model) / "config.json").read_text())
    rope = {"rope_type": "default", "rope_theta": config["rope_theta"], "partial_rotary_factor": config["partial_rotary_factor"]}
    return json.dumps({"rope_parameters": rope})
