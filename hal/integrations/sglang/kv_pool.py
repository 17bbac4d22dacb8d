"""SGLang's MHA KV pool with hal's split K/V pool as its storage: one copy of the KV.

SGLang's ``MHATokenToKVPool`` keeps per-layer K and V tensors of ``[size + page_size, heads, dim]``
rows, slot ``s`` at row ``s``, the first page absorbing padded writes. One layer of hal's pool,
``[num_pages + 1, page_size, heads, dim]`` with page 0 for padding, is the same memory viewed by
page, so SGLang's per-layer tensors become views of hal's buffers: SGLang code that reads or writes
``k_buffer[i]`` and hal's kernels see the same bytes.

SGLang's ``SWAKVPool`` (hybrid sliding-window models such as MiMo-V2-Flash) holds two such pools,
full and SWA, with their own sizes, head counts and dims; both become views of one hybrid hal pool
(``KVPoolSpec.swa``). SGLang maps full slots to SWA slots one by one and frees SWA pages that left
the window; ``mirror_swa_pages`` carries that mapping into hal's page mapping once per forward.
"""

from __future__ import annotations

from typing import Any

import torch

import hal
from hal.errors import CacheLocationError, UnsupportedConfigError
from hal.protocols import KVPool
from hal.spec import KVPoolSpec, SWAPoolSpec
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

# The attribute under which an SGLang pool keeps the hal pool that stores its KV.
_HAL_POOL_ATTR = "_hal_kv_pool"


def _mha_geometry(sgl_pool: Any, where: str) -> tuple[int, int, int]:
    """``(kv_heads, head_dim, v_head_dim)`` of an SGLang MHA pool hal can store; raises for the rest."""
    name = type(sgl_pool).__name__
    if not isinstance(sgl_pool, MHATokenToKVPool):
        raise UnsupportedConfigError(
            f"{where}{name}: hal stores SGLang's MHATokenToKVPool and the SWAKVPool of two of them; "
            "MLA, DSA and other pools are not supported"
        )
    if sgl_pool.is_quantized_kv_cache or sgl_pool.store_dtype != sgl_pool.dtype:
        raise UnsupportedConfigError(
            f"{where}{name}: a quantized KV cache (store dtype {sgl_pool.store_dtype}, compute dtype {sgl_pool.dtype}) "
            "is not stored by hal's pool; expected an unquantized float KV cache"
        )
    if sgl_pool.kv_cache_layout != "nhd":
        raise UnsupportedConfigError(f"{where}{name}: KV layout {sgl_pool.kv_cache_layout!r}; hal stores the 'nhd' layout only")
    if getattr(sgl_pool, "post_capture_active", False):
        raise UnsupportedConfigError(f"{where}{name}: post-capture KV backing is not supported by hal's pool")
    if sgl_pool.size % sgl_pool.page_size:
        raise UnsupportedConfigError(
            f"{where}{name}: size={sgl_pool.size} is not a multiple of page_size={sgl_pool.page_size}; hal pools hold whole pages"
        )
    return sgl_pool.head_num, sgl_pool.head_dim, sgl_pool.v_head_dim


def _swa_layer_ids(sgl_pool: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(full layer ids, SWA layer ids)`` of an SGLang ``SWAKVPool``, in sub-pool order."""
    by_kind: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
    for layer_id, (index, is_swa) in sgl_pool.layers_mapping.items():
        by_kind[bool(is_swa)].append((index, layer_id))
    full, swa = (tuple(layer for _, layer in sorted(by_kind[kind])) for kind in (False, True))
    if sorted(full + swa) != list(range(sgl_pool.layer_num)):
        raise UnsupportedConfigError(
            f"SWAKVPool: layers {sorted(full + swa)} are not 0..{sgl_pool.layer_num - 1}; hal's pool numbers its layers from 0"
        )
    return full, swa


def hal_pool_spec(sgl_pool: Any) -> KVPoolSpec:
    """The hal pool spec with ``sgl_pool``'s geometry; raises for layouts hal does not store.

    An ``SWAKVPool`` (full and sliding-window sub-pools, each an MHA pool with its own size, head
    count and dims) becomes one hybrid hal pool: its SWA part holds the sliding-window layers.
    """
    name = type(sgl_pool).__name__
    if isinstance(sgl_pool, SWAKVPool):
        if type(sgl_pool) is not SWAKVPool:
            raise UnsupportedConfigError(f"{name}: unified and draft-unified SWA pools are not stored by hal's pool; expected SWAKVPool")
        if sgl_pool.swa_req_ring_size is not None:
            raise UnsupportedConfigError(
                f"{name}: per-request SWA ring mode (swa_req_ring_size={sgl_pool.swa_req_ring_size}) is not supported; "
                "hal reads sliding-window layers through a paged SWA pool"
            )
        full_ids, swa_ids = _swa_layer_ids(sgl_pool)
        swa_heads, swa_dk, swa_dv = _mha_geometry(sgl_pool.swa_kv_pool, f"{name}.swa_kv_pool: ")
        full_heads, full_dk, full_dv = (
            _mha_geometry(sgl_pool.full_kv_pool, f"{name}.full_kv_pool: ") if full_ids else (swa_heads, swa_dk, swa_dv)
        )
        if sgl_pool.full_kv_pool.dtype != sgl_pool.swa_kv_pool.dtype:
            raise UnsupportedConfigError(
                f"{name}: full sub-pool dtype {sgl_pool.full_kv_pool.dtype} and SWA sub-pool dtype "
                f"{sgl_pool.swa_kv_pool.dtype} differ; hal's hybrid pool stores one dtype"
            )
        return KVPoolSpec(
            num_layers=sgl_pool.layer_num,
            size=sgl_pool.full_kv_pool.size,
            page_size=sgl_pool.page_size,
            kv_heads=full_heads,
            head_dim=full_dk,
            v_head_dim=full_dv,
            dtype=sgl_pool.swa_kv_pool.dtype,
            swa=SWAPoolSpec(layer_ids=swa_ids, size=sgl_pool.swa_kv_pool.size, kv_heads=swa_heads, head_dim=swa_dk, v_head_dim=swa_dv),
        )
    heads, dk, dv = _mha_geometry(sgl_pool, "")
    return KVPoolSpec(
        num_layers=sgl_pool.layer_num, size=sgl_pool.size, page_size=sgl_pool.page_size, kv_heads=heads, head_dim=dk,
        v_head_dim=dv, dtype=sgl_pool.dtype,
    )


def _view_layers(sgl_pool: Any, pool: KVPool, layer_ids: tuple[int, ...]) -> None:
    """Make ``sgl_pool``'s per-layer buffers the ``[slots, heads, dim]`` views of hal's layers ``layer_ids``."""
    sgl_pool.k_buffer = [pool.k_buffer(i).view(-1, *pool.k_buffer(i).shape[2:]) for i in layer_ids]
    sgl_pool.v_buffer = [pool.v_buffer(i).view(-1, *pool.v_buffer(i).shape[2:]) for i in layer_ids]
    # What SGLang derives from the buffers (transfer descriptors, data pointers and strides).
    sgl_pool._kv_buffer_descs = sgl_pool._build_kv_buffer_descs()
    sgl_pool._init_data_ptrs_and_strides()


def store_in_hal_pool(sgl_pool: Any, backend: hal.Backend) -> KVPool:
    """Give ``sgl_pool`` hal's split K/V pool as its storage and return that pool (made by
    ``backend``, the one the edge resolved: the platform's, or the attention backend's).

    SGLang's own buffers are released before hal's are allocated, so the two never coexist. An
    ``SWAKVPool``'s two sub-pools become views of one hybrid hal pool's full and SWA parts.
    Called again on the same SGLang pool, it returns the hal pool it already has.
    """
    existing = getattr(sgl_pool, _HAL_POOL_ATTR, None)
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    if not isinstance(backend, hal.Backend):
        raise UnsupportedConfigError(f"store_in_hal_pool: backend must be a hal.Backend (hal.get_backend(...)), got {backend!r}")
    spec = hal_pool_spec(sgl_pool)
    hybrid = spec.swa is not None
    sub_pools = (sgl_pool.full_kv_pool, sgl_pool.swa_kv_pool) if hybrid else (sgl_pool,)
    for sub in sub_pools:
        sub.k_buffer = sub.v_buffer = None
        if hasattr(sub, _HAL_POOL_ATTR):  # a HalMHATokenToKVPool built as a sub-pool: its own hal pool goes
            delattr(sub, _HAL_POOL_ATTR)
    pool = backend.create_kv_pool(spec)
    if hybrid:
        assert spec.swa is not None
        if spec.full_layer_ids:
            _view_layers(sgl_pool.full_kv_pool, pool, spec.full_layer_ids)
        _view_layers(sgl_pool.swa_kv_pool, pool, spec.swa.layer_ids)
    else:
        _view_layers(sgl_pool, pool, tuple(range(spec.num_layers)))
    setattr(sgl_pool, _HAL_POOL_ATTR, pool)
    return pool


def mirror_swa_pages(
    sgl_pool: Any, pool: KVPool, rows: torch.Tensor, page_table: torch.Tensor, kv_lens: list[int], q_lens: list[int],
    window: int | None,
) -> None:
    """Copy SGLang's full-to-SWA slot mapping for the pages of this batch into hal's page mapping.

    ``rows`` are the batch's ``req_to_token`` rows (host, ``[B, >= max kv_len]``) and ``page_table``
    the full-pool pages ``page_table_from_req_to_token`` made of them (0 past a request's own
    pages; page 0 is the padding page, never a request's). SGLang maps slot
    by slot and frees SWA pages outside the window; hal maps page by page. Every position a
    sliding-window layer can see this forward (``kv_len - q_len - window`` onwards; all of them
    without a window) must hold its page's SWA page at the same offset, else
    ``CacheLocationError`` names it: hal would read another request's keys, or freed ones.
    Pages no layer sees are mirrored as SGLang has them (0 when freed: the padding page). Padded
    rows (full slot 0, the padding slot) must map to SWA slot 0.
    """
    ps = pool.spec.page_size
    width = max(kv_lens, default=0)
    if not width:
        return
    mapping = sgl_pool.full_to_swa_index_mapping
    if mapping is None:
        raise CacheLocationError("SWAKVPool: no full-to-SWA mapping registered (no SWA allocator); hal cannot place SWA layers")
    slots = rows[:, :width].long()
    swa_slots = mapping[slots.to(mapping.device)].cpu()  # the forward's one read of SGLang's mapping
    position = torch.arange(width)
    kv = torch.tensor(kv_lens, dtype=torch.long).unsqueeze(1)
    first_seen = kv - torch.tensor(q_lens, dtype=torch.long).unsqueeze(1) - (width if window is None else window)
    used = position < kv
    seen = used & (position >= first_seen)
    swa_pages = torch.where(swa_slots[:, ::ps] > 0, torch.div(swa_slots[:, ::ps], ps, rounding_mode="floor"), 0)
    expect = swa_pages.repeat_interleave(ps, dim=1)[:, :width] * ps + position % ps
    # A padded row of a graph batch (and the batch a graph is captured on) reads the padding slot:
    # full slot 0 stands for SWA slot 0, and nothing else may map to either.
    padding = slots == 0
    wrong = seen & torch.where(padding, swa_slots != 0, (swa_slots <= 0) | (swa_slots != expect))
    if bool(wrong.any()):
        i, p = (int(x) for x in wrong.nonzero()[0])
        raise CacheLocationError(
            f"SWAKVPool: request {i} position {p} (full slot {int(slots[i, p])}) maps to SWA slot {int(swa_slots[i, p])}, "
            f"expected {int(expect[i, p])} (offset {p % ps} of the SWA page holding its page's first token, and not freed): "
            "a sliding-window layer reads this position"
        )
    page_used = page_table > 0
    full_pages = page_table[page_used]
    mirrored = swa_pages[page_used]
    if bool((mirrored > 0).any()):
        pool.map_swa_pages(full_pages[mirrored > 0], mirrored[mirrored > 0])
    if bool((mirrored == 0).any()):
        pool.unmap_swa_pages(full_pages[mirrored == 0])


class HalMHATokenToKVPool(MHATokenToKVPool):
    """``MHATokenToKVPool`` whose K/V buffers are views of hal's split K/V pool for the device.

    Constructed by SGLang with the in-tree class's keyword arguments (``v_head_dim`` included);
    only the storage differs. ``hal_pool`` is the pool hal's attention kernels read. SGLang gets
    the class from hal's platform bound to its backend (``hal_backend``); unbound it refuses.
    """

    #: The hal backend whose pool stores the KV; hal's platform binds it (``plugin.bound_to``).
    hal_backend: hal.Backend | None = None

    def _create_buffers(self) -> None:
        # The attributes the in-tree unquantized path sets besides the buffers.
        self.k_scale_buffer = self.v_scale_buffer = None
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        if self.layer_num == 0:  # the empty full side of a window-only SWAKVPool (an MTP draft's)
            empty: list[torch.Tensor] = []
            self.k_buffer, self.v_buffer = empty, list(empty)
            return
        store_in_hal_pool(self, self._backend())

    def _backend(self) -> hal.Backend:
        if self.hal_backend is None:
            raise UnsupportedConfigError(
                f"{type(self).__name__} has no hal backend: SGLang gets it from hal's platform (SGLANG_PLATFORM=hal), "
                "which binds the backend it resolved (``plugin.bound_to``)"
            )
        return self.hal_backend

    @property
    def hal_pool(self) -> KVPool:
        return store_in_hal_pool(self, self._backend())
