"""SGLang's MHA KV pool with hal's split K/V pool as its storage: one copy of the KV.

SGLang's ``MHATokenToKVPool`` keeps per-layer K and V tensors of ``[size + page_size, heads, dim]``
rows, slot ``s`` at row ``s``, the first page absorbing padded writes. One layer of hal's pool,
``[num_pages + 1, page_size, heads, dim]`` with page 0 for padding, is the same memory viewed by
page, so SGLang's per-layer tensors become views of hal's buffers: SGLang code that reads or writes
``k_buffer[i]`` and hal's kernels see the same bytes.
"""

from __future__ import annotations

from typing import Any

import torch

import hal
from hal.errors import UnsupportedConfigError
from hal.protocols import KVPool
from hal.spec import KVPoolSpec
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

# The attribute under which an SGLang pool keeps the hal pool that stores its KV.
_HAL_POOL_ATTR = "_hal_kv_pool"


def hal_backend_for(device: str | torch.device) -> hal.Backend:
    """hal's backend for an SGLang device string (``"cpu"``, ``"cuda"``, ``"npu:1"``, ...)."""
    return hal.get_backend(str(device))  # hal parses the string: torch may not know "npu" yet


def hal_pool_spec(sgl_pool: Any) -> KVPoolSpec:
    """The hal pool spec with ``sgl_pool``'s geometry; raises for layouts hal does not store."""
    name = type(sgl_pool).__name__
    if not isinstance(sgl_pool, MHATokenToKVPool):
        raise UnsupportedConfigError(
            f"{name}: hal stores SGLang's MHATokenToKVPool (one head count and head dims for every layer); "
            "hybrid and MLA pools are not supported"
        )
    if sgl_pool.is_quantized_kv_cache or sgl_pool.store_dtype != sgl_pool.dtype:
        raise UnsupportedConfigError(
            f"{name}: a quantized KV cache (store dtype {sgl_pool.store_dtype}, compute dtype {sgl_pool.dtype}) "
            "is not stored by hal's pool; expected an unquantized float KV cache"
        )
    if sgl_pool.kv_cache_layout != "nhd":
        raise UnsupportedConfigError(f"{name}: KV layout {sgl_pool.kv_cache_layout!r}; hal stores the 'nhd' layout only")
    if getattr(sgl_pool, "post_capture_active", False):
        raise UnsupportedConfigError(f"{name}: post-capture KV backing is not supported by hal's pool")
    if sgl_pool.size % sgl_pool.page_size:
        raise UnsupportedConfigError(
            f"{name}: size={sgl_pool.size} is not a multiple of page_size={sgl_pool.page_size}; hal pools hold whole pages"
        )
    return KVPoolSpec(
        num_layers=sgl_pool.layer_num,
        size=sgl_pool.size,
        page_size=sgl_pool.page_size,
        kv_heads=sgl_pool.head_num,
        head_dim=sgl_pool.head_dim,
        v_head_dim=sgl_pool.v_head_dim,
        dtype=sgl_pool.dtype,
    )


def store_in_hal_pool(sgl_pool: Any) -> KVPool:
    """Give ``sgl_pool`` hal's split K/V pool as its storage and return that pool.

    SGLang's own buffers are released before hal's are allocated, so the two never coexist. Called
    again on the same SGLang pool, it returns the hal pool it already has.
    """
    existing = getattr(sgl_pool, _HAL_POOL_ATTR, None)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    spec = hal_pool_spec(sgl_pool)
    sgl_pool.k_buffer = sgl_pool.v_buffer = None
    pool = hal_backend_for(sgl_pool.device).create_kv_pool(spec)
    rows = -1
    sgl_pool.k_buffer = [pool.k_buffer(i).view(rows, spec.kv_heads, spec.head_dim) for i in range(spec.num_layers)]
    sgl_pool.v_buffer = [pool.v_buffer(i).view(rows, spec.kv_heads, spec.v_head_dim) for i in range(spec.num_layers)]
    # What SGLang derives from the buffers (transfer descriptors, data pointers and strides).
    sgl_pool._kv_buffer_descs = sgl_pool._build_kv_buffer_descs()
    sgl_pool._init_data_ptrs_and_strides()
    setattr(sgl_pool, _HAL_POOL_ATTR, pool)
    return pool


class HalMHATokenToKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` whose K/V buffers are views of hal's split K/V pool for the device.

    Constructed by SGLang with the in-tree class's keyword arguments (``v_head_dim`` included);
    only the storage differs. ``hal_pool`` is the pool hal's attention kernels read.
    """

    def _create_buffers(self) -> None:
        # The attributes the in-tree unquantized path sets besides the buffers.
        self.k_scale_buffer = self.v_scale_buffer = None
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        store_in_hal_pool(self)

    @property
    def hal_pool(self) -> KVPool:
        return store_in_hal_pool(self)
