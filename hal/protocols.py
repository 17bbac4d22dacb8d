"""The three protocols a backend implements, and the backend bundle that makes them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import attrs
import torch

from hal.graph import GraphUpdate
from hal.metadata import AttentionMetadata
from hal.spec import KVPoolSpec, LayerSpec

T = TypeVar("T")


@runtime_checkable
class KVPool(Protocol):
    """Paged split-K/V storage: ``[layer, num_pages + 1, page_size, kv_heads, dim]`` per sub-pool.

    Slot ``loc`` is ``page * page_size + offset``; page 0 is the padding page that padded rows
    write to. Hybrid SWA pools keep SWA layers in a smaller sub-pool; callers always address
    tokens by full-pool slot and the pool translates through ``full_to_swa_page``.
    """

    spec: KVPoolSpec
    device: torch.device

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def k_buffer(self, layer: int) -> torch.Tensor: ...
    def v_buffer(self, layer: int) -> torch.Tensor: ...
    def bytes_per_token(self) -> int: ...
    def is_swa_layer(self, layer: int) -> bool: ...
    def swa_block_table(self, block_table: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class AttentionKernel(Protocol):
    """Paged attention for every forward mode (see ``hal.metadata`` for the conventions)."""

    pool: KVPool
    # KV length of a padded request's first token in a padded graph batch (0 or 1 usually).
    seq_len_fill_value: int

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, v_head_dim]
        layer: LayerSpec,
        metadata: AttentionMetadata,
        save_kv_cache: bool = True,
        *,
        sinks: torch.Tensor | None = None,  # [num_q_heads], when layer.has_sinks
    ) -> torch.Tensor:  # [T, num_q_heads, v_head_dim]
        ...

    def updatable_params(self, metadata: AttentionMetadata, layer: LayerSpec) -> Mapping[str, Any]:
        """Host-side parameters of one captured call for ``metadata`` (empty if none)."""
        ...


@runtime_checkable
class Graph(Protocol):
    """Capture once, replay many times; ``replay(update)`` applies what changed first."""

    captured_calls: Sequence[tuple[AttentionKernel, LayerSpec]]

    def capture(self, fn: Callable[[], T], *, pool: Any = None) -> T: ...
    def replay(self, update: GraphUpdate | None = None) -> None: ...


@attrs.frozen
class Availability:
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
    device: torch.device

    @classmethod
    def probe(cls) -> Availability: ...

    @classmethod
    def is_available(cls) -> bool: ...

    def create_kv_pool(self, spec: KVPoolSpec) -> KVPool: ...
    def create_attention(self, pool: KVPool) -> AttentionKernel: ...
    def create_graph(self) -> Graph: ...
    def graph_memory_pool(self) -> Any: ...
    def synchronize(self) -> None: ...
