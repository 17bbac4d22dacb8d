"""The ``oot`` backend: host memory, a host-parameter attention op and a graph that bakes it."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from backends.cpu.attention import paged_attention
from hal.attention import block_table_for, validate_attention_call
from hal.errors import GraphError
from hal.graph import GraphUpdate, capture_span, copy_into, record_updatable_call
from hal.kv_pool import SplitKVPool
from hal.metadata import AttentionMetadata
from hal.protocols import Availability, KVPool
from hal.spec import KVPoolSpec, LayerSpec

T = TypeVar("T")
_ALIGN = 64  # elements; each buffer starts on an aligned offset of the arena

# What a ReplayGraph collects while capturing (.baked) and feeds its calls while replaying (.feed).
_replay = threading.local()


class ArenaKVPool(SplitKVPool):
    """hal's split K/V layout, with every buffer carved from one zeroed arena per pool."""

    def __init__(self, spec: KVPoolSpec, device: torch.device | str = "cpu") -> None:
        self._arena = torch.zeros(self._arena_elements(spec), dtype=spec.dtype, device=device)
        self._used = 0
        super().__init__(spec, device)

    @staticmethod
    def _arena_elements(spec: KVPoolSpec) -> int:
        total = 0
        for layer in range(spec.num_layers):
            heads, dk, dv = spec.layer_dims(layer)
            pages = (spec.swa_num_pages if spec.is_swa_layer(layer) else spec.num_pages) + 1
            total += pages * spec.page_size * heads * (dk + dv)
        return total + 4 * _ALIGN  # alignment slack for the (at most four) sub-pool buffers

    def _allocate(self, shape: tuple[int, ...]) -> torch.Tensor:
        start = -(-self._used // _ALIGN) * _ALIGN
        n = math.prod(shape)
        self._used = start + n
        return self._arena[start : start + n].view(shape)

    def _write_rows(self, buffer: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
        buffer.index_put_((loc,), rows)


class HostLenAttention:
    """Paged attention whose op reads per-request lengths from host lists (FIA-style)."""

    seq_len_fill_value = 1

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def updatable_params(self, metadata: AttentionMetadata, layer: LayerSpec) -> Mapping[str, Any]:
        """The host arguments of one call: what a graph update must refresh."""
        return {"kv_lens": list(metadata.kv_lens_cpu), "cu_q_lens": [0, *metadata.cu_q_lens_cpu]}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: LayerSpec,
        metadata: AttentionMetadata,
        save_kv_cache: bool = True,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        validate_attention_call(self.pool, q, k, v, layer, metadata, sinks)
        params = self.updatable_params(metadata, layer)
        record_updatable_call(self, layer)
        baked: list[Mapping[str, Any]] | None = getattr(_replay, "baked", None)
        if baked is not None:
            baked.append(params)  # capture: the arguments this call is captured with
        feed: Iterator[Mapping[str, Any]] | None = getattr(_replay, "feed", None)
        if feed is not None:
            params = next(feed)  # replay: the baked (or updated) host arguments of this call
        if save_kv_cache:
            self.pool.set_kv(layer.layer_id, metadata.out_cache_loc, k, v)
        dev = q.device
        return paged_attention(
            q,
            self.pool.k_buffer(layer.layer_id),
            self.pool.v_buffer(layer.layer_id),
            block_table_for(self.pool, layer, metadata),
            torch.tensor(params["kv_lens"], dtype=torch.int32, device=dev),
            torch.tensor(params["cu_q_lens"], dtype=torch.int32, device=dev),
            scaling=layer.scaling,
            sliding_window=layer.sliding_window,
            sinks=sinks,
        )


class ReplayGraph:
    """Captures ``fn`` and the host arguments of its updatable calls; replay re-runs ``fn`` with
    those arguments, replaced by ``update.host_params`` when given (stale otherwise, as on Ascend)."""

    def __init__(self) -> None:
        self._fn: Callable[[], Any] | None = None
        self._outputs: Any = None
        self._params: list[Mapping[str, Any]] = []
        self.captured_calls: list[tuple[Any, Any]] = []

    def capture(self, fn: Callable[[], T], *, pool: Any = None) -> T:
        if self._fn is not None:
            raise GraphError("ReplayGraph.capture: this graph is already captured")
        _replay.baked = []
        try:
            with capture_span() as calls:
                outputs = fn()
        finally:
            baked, _replay.baked = _replay.baked, None
        self._fn, self._outputs, self.captured_calls, self._params = fn, outputs, list(calls), baked
        return outputs

    def replay(self, update: GraphUpdate | None = None) -> None:
        if self._fn is None:
            raise GraphError("ReplayGraph.replay: capture() first")
        if update is not None:
            update.apply_buffer_copies()
            if update.host_params:
                if len(update.host_params) != len(self.captured_calls):
                    raise GraphError(
                        f"ReplayGraph.replay: {len(update.host_params)} host parameter sets for "
                        f"{len(self.captured_calls)} captured calls"
                    )
                self._params = [dict(p) for p in update.host_params]
        _replay.feed = iter(self._params)
        try:
            copy_into(self._outputs, self._fn())
        finally:
            _replay.feed = None


class OotBackend:
    """Bundle for device type ``oot`` (tensors in host memory)."""

    name = "oot"
    device_type = "oot"
    collective_backend = "gloo"

    def __init__(self, index: int | None = None) -> None:
        self.device = torch.device("cpu")

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, "out-of-tree example on host memory", device_count=1)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def create_kv_pool(self, spec: KVPoolSpec) -> ArenaKVPool:
        return ArenaKVPool(spec, self.device)

    def create_attention(self, pool: KVPool) -> HostLenAttention:
        return HostLenAttention(pool)

    def create_graph(self) -> ReplayGraph:
        return ReplayGraph()

    def graph_memory_pool(self) -> None:
        return None

    def synchronize(self) -> None:
        pass
