"""``BackendBase``: the backend bundle with defaults, so a backend states only what differs.

A backend names its classes (``kv_pool_class``, ``attention_class``, ``graph_class``), says how
it finds its hardware (``probe``) and, where they are not no-ops, how it synchronizes and which
memory pool its graphs share. ``is_available`` and the three factories come from here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from hal.errors import BackendUnavailableError, SpecError, UnsupportedConfigError
from hal.graph import EagerGraph, GraphBase
from hal.kv_pool import SplitKVPool, check_pool_size
from hal.protocols import Availability, AttentionKernel, KVPool
from hal.spec import FLOAT_DTYPES, KVPoolSpec, LayerSpec, int_at_least

def host_memory_bytes() -> int | None:
    """The host's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class BackendBase:
    """Base class of ``Backend`` implementations, constructed by the registry as ``cls(index=...)``.

    ``auto_priority``: where ``hal.get_backend("auto")`` tries this backend (higher first; the
    built-in ones are npu 300, cuda 200, cpu 0). ``None`` keeps it out of ``"auto"``: it is used
    only when named. Threading: a backend and the pools it creates may be shared across threads;
    see ``AttentionKernelBase`` and ``GraphBase`` for kernels and graphs.
    """

    name: ClassVar[str]
    device_type: ClassVar[str]
    collective_backend: ClassVar[str] = "gloo"  # hccl / nccl / gloo
    auto_priority: ClassVar[int | None] = None
    kv_pool_class: ClassVar[type[SplitKVPool]] = SplitKVPool
    attention_class: ClassVar[type[Any]]
    graph_class: ClassVar[type[GraphBase]] = EagerGraph
    #: Tensors live in host memory (``torch.device("cpu")``, whatever the index).
    host_memory: ClassVar[bool] = False
    #: KV page size engines use unless told otherwise (one the backend's kernel takes for every mode).
    default_page_size: ClassVar[int] = 16
    #: Dtype engines load model weights in unless told otherwise (what the device computes fastest
    #: without giving up accuracy the reference needs: float32 on the host, bfloat16 on accelerators).
    preferred_dtype: ClassVar[torch.dtype] = torch.float32
    #: KV dtypes ``kv_dtype_for`` tries after the caller's own, in order (every one in ``FLOAT_DTYPES``):
    #: the reference's precision first on the host; accelerators put bfloat16 first.
    kv_dtype_preference: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    #: Whether a replay of ``graph_class`` skips the Python that captured it. False for graphs that
    #: re-run their function (``EagerGraph``): ``hal.GraphRunner`` then runs each batch eagerly at its
    #: real size instead of padding it to a captured one and copying it into static buffers.
    captures_graphs: ClassVar[bool] = False

    def __init__(self, index: int | None = None, *, emulated: bool = False) -> None:
        if emulated and self.probe_emulation() is None:
            raise BackendUnavailableError(f"backend {self.name!r} has no emulator (its probe_emulation() returns None)")
        self.index = index
        #: Runs on the backend's CPU emulator of its vendor runtime, held by this instance only.
        self.emulated = emulated
        self.device = self._tensor_device(index)

    def _tensor_device(self, index: int | None) -> torch.device:
        """Where this backend's tensors live (default: ``device_type[:index]``, or the host)."""
        if self.host_memory:
            return torch.device("cpu")
        return torch.device(self.device_type, index) if index is not None else torch.device(self.device_type)

    @classmethod
    def probe(cls) -> Availability:
        """Cheap availability check: no device work, no eager import of the vendor runtime."""
        raise NotImplementedError(f"{cls.__name__} must implement probe()")

    @classmethod
    def probe_emulation(cls) -> Availability | None:
        """Whether this backend can run on a CPU emulator of its runtime (``emulated=True``, what
        ``hal.get_backend(device, emulate=True)`` builds); None when it has no emulator. An emulated
        instance reaches its emulator through handles of its own: it changes nothing process-wide."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        """``probe().available``."""
        return cls.probe().available

    def for_rank(self, local_rank: int) -> BackendBase:
        """This backend for local rank ``local_rank`` of a tensor-parallel group: device
        ``index + local_rank`` (the same backend where tensors live in host memory)."""
        local_rank = int_at_least(local_rank, 0, "for_rank: local_rank")
        if self.host_memory or local_rank == 0:
            return self
        if self.emulated:
            return type(self)((self.index or 0) + local_rank, emulated=True)
        return type(self)((self.index or 0) + local_rank)

    def memory_bytes(self) -> int | None:
        """The device's memory in bytes (None when the backend cannot tell; backends with a memory
        query override this): the host's physical memory for a backend whose tensors live there."""
        return host_memory_bytes() if self.host_memory else None

    def create_kv_pool(self, spec: KVPoolSpec, *, storage: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> KVPool:
        """A split-K/V paged pool of ``kv_pool_class`` on this backend's device; a spec whose
        buffers would not fit the device is refused (``PoolTooLargeError``) before allocating.
        ``storage``: every layer's (K, V) buffers when the engine allocates the KV memory (one
        ``[pages + 1, page_size, kv_heads, dim]`` tensor each, checked); the pool is then their view."""
        if not isinstance(spec, KVPoolSpec):
            raise SpecError(f"create_kv_pool: spec must be a hal.KVPoolSpec, got {type(spec).__name__}")
        options = self.kv_pool_options()
        if storage is None:  # a pool class of its own may take no storage
            check_pool_size(spec, self.memory_bytes())
            return self.kv_pool_class(spec, self.device, **options)
        return self.kv_pool_class(spec, self.device, storage=storage, **options)

    def kv_pool_options(self) -> dict[str, Any]:
        """Keyword arguments ``kv_pool_class`` is built with beside spec, device and storage (a
        backend's runtime handles, which its kernel then reads from the pool); none by default."""
        return {}

    def create_attention(self, pool: KVPool) -> AttentionKernel:
        """An ``attention_class`` kernel over ``pool``."""
        if not isinstance(getattr(pool, "spec", None), KVPoolSpec):
            raise SpecError(f"create_attention: pool must be a KV pool (see create_kv_pool), got {type(pool).__name__}")
        return self.attention_class(pool)  # type: ignore[no-any-return]

    def unsupported_reason(
        self, layer: LayerSpec, kv_dtype: torch.dtype, page_size: int, *, max_q_len: int = 1, batch_size: int = 1
    ) -> str | None:
        """Why this backend's kernel cannot run ``layer`` with KV in ``kv_dtype`` and pages of
        ``page_size``, for batches of up to ``batch_size`` requests of up to ``max_q_len`` new tokens
        each; None if it can. Allocates nothing."""
        return self.attention_class.unsupported_reason(layer, kv_dtype, page_size, max_q_len, batch_size)  # type: ignore[no-any-return]

    def check_layers(
        self, layers: Sequence[LayerSpec], kv_dtype: torch.dtype, page_size: int, *, max_q_len: int = 1, batch_size: int = 1
    ) -> None:
        """``UnsupportedConfigError`` naming the first of ``layers`` the kernel cannot run (see
        ``unsupported_reason``), before anything is allocated."""
        for layer in layers:
            reason = self.unsupported_reason(layer, kv_dtype, page_size, max_q_len=max_q_len, batch_size=batch_size)
            if reason is not None:
                raise UnsupportedConfigError(f"backend {self.name!r}, layer {layer.layer_id}: {reason}")

    def kv_dtype_for(
        self,
        layers: Sequence[LayerSpec],
        page_size: int,
        *,
        prefer: torch.dtype | None = None,
        max_q_len: int = 1,
        batch_size: int = 1,
    ) -> torch.dtype:
        """The KV dtype to store ``layers`` in: ``prefer`` (an engine passes its model's compute dtype,
        as SGLang's and vLLM's ``kv_cache_dtype="auto"`` do) where the kernel runs every layer in it,
        else the first of ``kv_dtype_preference`` that it does; ``UnsupportedConfigError`` naming a
        layer when none runs them all."""
        if prefer is not None and prefer not in FLOAT_DTYPES:
            raise SpecError(f"kv_dtype_for: prefer must be one of {[str(d) for d in FLOAT_DTYPES]} or None, got {prefer!r}")
        candidates = ((prefer,) if prefer is not None else ()) + self.kv_dtype_preference
        for dtype in candidates:
            if all(self.unsupported_reason(layer, dtype, page_size, max_q_len=max_q_len, batch_size=batch_size) is None
                   for layer in layers):
                return dtype
        # Named in the backend's own first choice: the reason is then not "wrong dtype" but what else is wrong.
        self.check_layers(layers, self.kv_dtype_preference[0], page_size, max_q_len=max_q_len, batch_size=batch_size)
        raise AssertionError("unreachable")  # check_layers raised for the layer that fails

    def create_graph(self, *, tp_group: Any = None) -> GraphBase:
        """A fresh, uncaptured ``graph_class`` graph; with ``tp_group``, its capture waits on that
        tensor-parallel group's barrier (every rank warms up, then captures together)."""
        return self.graph_class(tp_group=tp_group)  # type: ignore[call-arg]

    def graph_memory_pool(self) -> Any:
        """A memory-pool handle the graphs of one runner share (None: the runtime has none)."""
        return None

    def synchronize(self) -> None:
        """Wait for all queued device work (a no-op where work runs synchronously)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}{', emulated' if getattr(self, 'emulated', False) else ''})"
