"""The ``oot`` backend: host memory, a host-parameter attention op and a graph that bakes it.

Written as a third party would, against ``hal.sdk`` alone.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from hal.sdk import (
    AttentionKernelBase,
    AttentionMetadata,
    Availability,
    BackendBase,
    ForwardPlan,
    GraphBase,
    KVPoolSpec,
    LayerSpec,
    SplitKVPool,
    copy_into,
    paged_oracle,
)

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


class HostLenAttention(AttentionKernelBase):
    """Paged attention whose op reads per-request lengths from host lists (FIA-style)."""

    serves_trees = True  # the op takes the verify batch's tree mask

    def updatable_params(self, metadata: AttentionMetadata, layer: LayerSpec) -> Mapping[str, Any]:
        """The host arguments of one call: what a graph update must refresh."""
        return {"kv_lens": list(metadata.kv_lens_cpu), "cu_q_lens": [0, *metadata.cu_q_lens_cpu]}

    def _attend(
        self, q: torch.Tensor, layer: LayerSpec, plan: ForwardPlan, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        metadata = plan.metadata
        params = self.updatable_params(metadata, layer)
        self.record_updatable_call(layer)
        baked: list[Mapping[str, Any]] | None = getattr(_replay, "baked", None)
        if baked is not None:
            baked.append(params)  # capture: the arguments this call is captured with
        feed: Iterator[Mapping[str, Any]] | None = getattr(_replay, "feed", None)
        if feed is not None:
            params = next(feed)  # replay: the baked (or updated) host arguments of this call
        dev = q.device
        return paged_oracle(  # the definition itself, as this example's "device op"
            q,
            self.pool.k_buffer(layer.layer_id),
            self.pool.v_buffer(layer.layer_id),
            self.block_table(layer, metadata),
            torch.tensor(params["kv_lens"], dtype=torch.int32, device=dev),
            torch.tensor(params["cu_q_lens"], dtype=torch.int32, device=dev),
            scaling=layer.scaling,
            sliding_window=layer.sliding_window,
            sinks=sinks,
            tree_mask=metadata.tree_mask,  # a device tensor: a replay's copies refresh it in place
        ).to(q.dtype)


class ReplayGraph(GraphBase):
    """Captures ``fn`` and the host arguments of its updatable calls; replay re-runs ``fn`` with
    those arguments, replaced by ``update.host_params`` when given (stale otherwise, as on Ascend)."""

    takes_host_params = True

    def __init__(self, *, tp_group: Any = None) -> None:
        super().__init__(tp_group=tp_group)
        self._fn: Callable[[], Any] | None = None
        self._params: list[Mapping[str, Any]] = []

    def _capture(self, fn: Callable[[], T], memory_pool: Any) -> T:
        _replay.baked = []
        try:
            outputs = fn()
        finally:
            baked, _replay.baked = _replay.baked, None
        self._fn, self._params = fn, baked
        return outputs

    def _replay(self, host_params: tuple[Mapping[str, Any], ...]) -> None:
        assert self._fn is not None
        if host_params:
            self._params = list(host_params)
        _replay.feed = iter(self._params)
        try:
            copy_into(self._outputs, self._fn())
        finally:
            _replay.feed = None


class OotBackend(BackendBase):
    """Bundle for device type ``oot`` (tensors in host memory)."""

    name = "oot"
    device_type = "oot"
    collective_backend = "gloo"
    kv_pool_class = ArenaKVPool
    attention_class = HostLenAttention
    graph_class = ReplayGraph
    host_memory = True

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, "out-of-tree example on host memory", device_count=1)
