"""``CudaGraph``: ``torch.cuda.CUDAGraph`` behind the ``Graph`` protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hal.errors import GraphError
from hal.graph import GraphUpdate, capture_span

T = TypeVar("T")


class CudaGraph:
    """Warm up on a side stream (Triton compiles there, outside the capture), then capture.

    ``replay(update)`` copies ``update.buffer_copies`` into the captured static buffers on the
    current stream and replays; the kernels read only device buffers, so host-side parameter
    updates are rejected rather than silently lost.
    """

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: Any = None
        self.captured_calls: list = []

    def capture(self, fn: Callable[[], T], *, pool: Any = None) -> T:
        if self._graph is not None:
            raise GraphError("CudaGraph.capture: this graph is already captured")
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                fn()
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capture_span() as calls, torch.cuda.graph(graph, pool=pool):
            outputs = fn()
        self._graph, self._outputs, self.captured_calls = graph, outputs, calls
        return outputs

    def replay(self, update: GraphUpdate | None = None) -> None:
        if self._graph is None:
            raise GraphError("CudaGraph.replay: capture() first")
        if update is not None:
            update.require_no_host_params("CudaGraph")
            update.apply_buffer_copies()
        self._graph.replay()
