"""The three protocols a backend implements, and the backend bundle that makes them.

These are the types engine code holds; ``hal.sdk`` has base classes that implement them.

The kernel-to-graph contract: an attention op whose captured form bakes host-side arguments
(Ascend FIA's ``actual_seq_kvlen``) must get fresh values on every replay. While a graph captures
(inside ``hal.graph.capture_span()``), the kernel calls ``hal.graph.record_updatable_call(kernel,
layer)`` once per such op; the graph keeps those pairs, in capture order, as ``captured_calls``.
Before each replay ``hal.GraphRunner`` asks each recorded kernel for
``updatable_params(metadata, layer)`` and passes the results, one mapping per captured call, as
``GraphUpdate.host_params``; a graph that cannot apply them refuses them (``GraphError``) rather
than replaying stale values. Kernels that read only device tensors record nothing.

Threading contract:
- ``KVPool``: ``set_kv`` calls from several threads are safe when they write different slots
  (different layers always do); two concurrent writes to one slot leave either value.
- ``AttentionKernel``: ``forward`` is safe from several threads at once (scratch is per thread).
- ``Graph``: one thread at a time captures or replays a graph (its static buffers are shared);
  ``hal.GraphRunner.run`` refuses a second concurrent caller with ``GraphError``.
- ``Backend``: its factories may be called from any thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import attrs
import torch

from hal.graph import GraphUpdate
from hal.metadata import AddressedPool, AttentionMetadata
from hal.plan import ForwardPlan
from hal.spec import KVPoolSpec, LayerSpec

T = TypeVar("T")


@runtime_checkable
class KVPool(AddressedPool, Protocol):
    """Paged split-K/V storage: ``[layer, num_pages + 1, page_size, kv_heads, dim]`` per sub-pool.

    Slot ``loc`` is ``page * page_size + offset``; page 0 is the padding page that padded rows
    write to. Hybrid SWA pools keep SWA layers in a smaller sub-pool; callers always address
    tokens by full-pool slot and the pool translates through ``full_to_swa_page``. ``spec``,
    ``device``, ``check_slots``, ``check_pages`` and ``swa_block_table``: see ``AddressedPool``.
    """

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k[i]``/``v[i]`` at full-pool slot ``loc[i]``; bad input raises and writes nothing."""
        ...

    def set_kv_for_forward(self, layer: int, plan: ForwardPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """``set_kv`` at the plan's ``out_cache_loc``, what an attention kernel writes every layer: the
        plan step checked the slot ids once per forward, and what is derived from them (SWA slots) is
        derived once per plan, so a layer reads no device values."""
        ...

    def slots_for_forward(self, layer: int, plan: ForwardPlan, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The int64 slots of the layer's own sub-pool (``k_buffer(layer)`` viewed as ``[slots, ...]``)
        that ``set_kv_for_forward`` would write ``k`` and ``v`` to, after the same checks: for a
        kernel that writes the rows itself as it attends."""
        ...

    def k_buffer(self, layer: int) -> torch.Tensor:
        """``[pages + 1, page_size, kv_heads, head_dim]`` view of the layer's K (its own sub-pool)."""
        ...

    def v_buffer(self, layer: int) -> torch.Tensor:
        """``[pages + 1, page_size, kv_heads, v_head_dim]`` view of the layer's V."""
        ...

    def bytes_per_token(self) -> int:
        """K + V bytes one token takes, summed over all layers."""
        ...

    def is_swa_layer(self, layer: int) -> bool:
        """Whether the layer lives in the sliding-window sub-pool."""
        ...

    def map_swa_pages(self, full_pages: torch.Tensor, swa_pages: torch.Tensor) -> None:
        """Back full pages ``1..num_pages`` with SWA pages ``1..swa_num_pages`` (an allocator's job)."""
        ...

    def unmap_swa_pages(self, full_pages: torch.Tensor) -> None:
        """Drop the SWA backing of full pages: reads through them see the padding page."""
        ...



@runtime_checkable
class AttentionKernel(Protocol):
    """Paged attention for every forward mode (see ``hal.metadata`` for the conventions).

    Every argument is validated before anything is written: a refused call leaves the cache as it
    was. Safe to call from several threads at once.
    """

    pool: KVPool
    # KV length of a padded request's first token in a padded graph batch (0 or 1 usually).
    seq_len_fill_value: int

    def plan(self, metadata: AttentionMetadata) -> ForwardPlan:
        """One forward's plan over this kernel's pool (``hal.plan``): the caller asks once per
        forward, inside the capture when the forward is captured, and hands it to every layer."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, v_head_dim]
        layer: LayerSpec,
        plan: ForwardPlan,
        save_kv_cache: bool = True,
        *,
        sinks: torch.Tensor | None = None,  # [num_q_heads], when layer.has_sinks
        out: torch.Tensor | None = None,  # [T, num_q_heads, v_head_dim], q's dtype and device: written and returned
    ) -> torch.Tensor:  # [T, num_q_heads, v_head_dim]
        """Write the new K/V (when ``save_kv_cache``) and attend over the paged cache, into ``out``
        when given (an engine's preallocated output: no new tensor, no copy where the kernel writes
        there itself)."""
        ...

    def updatable_params(self, metadata: AttentionMetadata, layer: LayerSpec) -> Mapping[str, Any]:
        """Host-side parameters of one captured call for ``metadata`` (empty if none): what a graph
        update must refresh for each call this kernel recorded during capture."""
        ...


@runtime_checkable
class Graph(Protocol):
    """Capture once, replay many times; ``replay(update)`` applies what changed first.

    One thread at a time captures or replays a graph.
    """

    #: (kernel, layer) of every updatable op recorded during capture, in capture order.
    captured_calls: Sequence[tuple[AttentionKernel, LayerSpec]]

    def capture(self, fn: Callable[[], T], *, memory_pool: Any = None) -> T:
        """Capture ``fn`` (inside ``hal.graph.capture_span()``); returns its static outputs.

        ``memory_pool``: the runtime's graph memory-pool handle (``Backend.graph_memory_pool()``)
        that graphs of one runner share; None for a private pool or where there is none."""
        ...

    def replay(self, update: GraphUpdate | None = None) -> None:
        """Apply ``update`` (buffer copies, then host params), then replay into the static outputs."""
        ...


@attrs.frozen
class Availability:
    """What ``Backend.probe()`` found: usable or not, and why."""

    available: bool
    reason: str  # why not, or a short description of what was found
    device_count: int = 0
    versions: Mapping[str, str] = attrs.Factory(dict)


@runtime_checkable
class Backend(Protocol):
    """The bundle ``hal.get_backend`` returns: factories for the three protocols."""

    name: ClassVar[str]
    device_type: ClassVar[str]
    collective_backend: ClassVar[str]  # hccl / nccl / gloo
    default_page_size: ClassVar[int]  # KV page size engines use unless told otherwise
    preferred_dtype: ClassVar[torch.dtype]  # weights' dtype engines load in unless told otherwise
    kv_dtype_preference: ClassVar[tuple[torch.dtype, ...]]  # KV dtypes kv_dtype_for tries, in order
    captures_graphs: ClassVar[bool]  # False: its graphs re-run Python, so runners run batches eagerly
    device: torch.device

    @classmethod
    def probe(cls) -> Availability:
        """Cheap availability check (no device work); the registry reports its reason."""
        ...

    @classmethod
    def is_available(cls) -> bool:
        """``probe().available``."""
        ...

    def create_kv_pool(self, spec: KVPoolSpec, *, storage: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> KVPool:
        """A split-K/V paged pool on this backend's device; over ``storage`` (every layer's K and
        V buffer, allocated by an engine) when given."""
        ...

    def create_attention(self, pool: KVPool) -> AttentionKernel:
        """The attention kernel for ``pool`` (every forward mode)."""
        ...

    def create_graph(self, *, tp_group: Any = None) -> Graph:
        """A fresh, uncaptured graph (its capture waits on ``tp_group``'s barrier when given)."""
        ...

    def unsupported_reason(
        self, layer: LayerSpec, kv_dtype: torch.dtype, page_size: int, *, max_q_len: int = 1, batch_size: int = 1
    ) -> str | None:
        """Why the kernel cannot run ``layer`` with this KV dtype, page size and batch bound; None if it can."""
        ...

    def check_layers(
        self, layers: Sequence[LayerSpec], kv_dtype: torch.dtype, page_size: int, *, max_q_len: int = 1, batch_size: int = 1
    ) -> None:
        """``UnsupportedConfigError`` naming the first layer the kernel cannot run, before allocating."""
        ...

    def kv_dtype_for(
        self,
        layers: Sequence[LayerSpec],
        page_size: int,
        *,
        prefer: torch.dtype | None = None,
        max_q_len: int = 1,
        batch_size: int = 1,
    ) -> torch.dtype:
        """The KV dtype for ``layers``: ``prefer`` where the kernel runs them all in it, else the
        first of the backend's ``kv_dtype_preference`` that it does."""
        ...

    def for_rank(self, local_rank: int) -> Backend:
        """This backend for local rank ``local_rank`` of a tensor-parallel group."""
        ...

    def graph_memory_pool(self) -> Any:
        """A memory-pool handle graphs of one runner share (None where not applicable)."""
        ...

    def synchronize(self) -> None:
        """Wait for all queued device work (timing, host reads)."""
        ...
