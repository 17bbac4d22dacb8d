"""``CudaGraph``: ``torch.cuda.CUDAGraph`` behind hal's ``GraphBase``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from hal.sdk import GraphBase

T = TypeVar("T")


class CudaGraph(GraphBase):
    """Warm up on a side stream (Triton compiles there, outside the capture), then capture.

    ``replay(update)`` copies ``update.buffer_copies`` into the captured static buffers on the
    current stream and replays; the kernels read only device buffers, so host-side parameter
    updates are refused rather than silently lost.
    """

    def __init__(self, device: torch.device, warmup_runs: int = 2, *, tp_group: Any = None) -> None:
        super().__init__(warmup_runs=warmup_runs, tp_group=tp_group)
        self.device = device
        self._graph: torch.cuda.CUDAGraph | None = None

    def _warm_up(self, fn: Callable[[], Any]) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            super()._warm_up(fn)
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)

    def _capture(self, fn: Callable[[], T], memory_pool: Any) -> T:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=memory_pool):
            outputs = fn()
        self._graph = graph
        return outputs

    def _replay(self, host_params: tuple[Mapping[str, Any], ...]) -> None:
        assert self._graph is not None
        self._graph.replay()
