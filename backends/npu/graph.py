"""``Graph`` on Ascend: ``torch.npu.NPUGraph`` with auto-dispatch capture and host-parameter updates.

A captured FIA call bakes its host arguments (``actual_seq_kvlen``...) into the graph task. Each
replay therefore re-issues them with ``graph.update(cpu_update_input=[...])`` on a worker thread
while ``graph.replay()`` runs on the caller's thread: the replay's device stream waits at every
captured FIA op until the update for it has landed. Any exception of the update thread is raised
in the caller, since a lost update means attention over stale lengths.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from backends.npu import runtime
from hal.errors import GraphError
from hal.graph import GraphUpdate, capture_span

T = TypeVar("T")


class NpuGraph:
    """Capture ``fn`` once into an NPUGraph; ``replay(update)`` refreshes buffers and host params."""

    def __init__(self, *, stream: Any = None, tp_group: Any = None, warmup_runs: int = 2) -> None:
        if warmup_runs < 0:
            raise GraphError(f"NpuGraph.warmup_runs must be >= 0, got {warmup_runs}")
        self.captured_calls: list[tuple[Any, Any]] = []
        self.warmup_runs = warmup_runs
        self._stream = stream
        self._tp_group = tp_group
        self._graph: Any = None
        self._outputs: Any = None

    def _barrier(self) -> None:
        """Every tensor-parallel rank finishes warm-up before any starts capturing."""
        if self._tp_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self._tp_group)

    def capture(self, fn: Callable[[], T], *, pool: Any = None) -> T:
        if self._graph is not None:
            raise GraphError("NpuGraph.capture: this graph is already captured")
        npu = runtime.npu()
        stream = self._stream if self._stream is not None else npu.Stream()
        stream.wait_stream(npu.current_stream())
        with npu.stream(stream):
            for _ in range(self.warmup_runs):  # lazy init, workspace sizing, full eager validation
                fn()
        npu.synchronize()
        self._barrier()
        graph = npu.NPUGraph()
        with capture_span() as calls:
            with npu.graph(graph, pool=pool, stream=stream, auto_dispatch_capture=True):
                outputs = fn()
        self._graph, self._outputs, self.captured_calls = graph, outputs, list(calls)
        return outputs

    def _update_list(self, update: GraphUpdate | None) -> list[Mapping[str, Any]]:
        """One dict per captured FIA op; an empty update re-issues the ops unchanged."""
        n = len(self.captured_calls)
        params: Sequence[Mapping[str, Any]] = () if update is None else update.host_params
        if not params:
            return [{}]
        if len(params) != n:
            raise GraphError(
                f"NpuGraph.replay: update has {len(params)} host-parameter dicts, the graph captured {n} FIA calls"
            )
        return [dict(p) for p in params]

    def replay(self, update: GraphUpdate | None = None) -> None:
        if self._graph is None:
            raise GraphError("NpuGraph.replay: capture() first")
        host_params = self._update_list(update)
        npu = runtime.npu()
        # The previous replay must be done before its captured ops' parameters are rewritten.
        npu.synchronize()
        if update is not None:
            update.apply_buffer_copies()
        graph = self._graph
        failures: list[BaseException] = []

        def push_update() -> None:
            try:
                graph.update(cpu_update_input=host_params)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller below
                failures.append(exc)

        worker = threading.Thread(target=push_update, name="npu-graph-update", daemon=True)
        worker.start()
        replay_error: BaseException | None = None
        try:
            graph.replay()
        except BaseException as exc:  # noqa: BLE001 - the update failure, if any, is the cause
            replay_error = exc
        finally:
            worker.join()
        if failures:
            cause = failures[0]
            raise GraphError(
                f"NpuGraph.replay: graph.update(cpu_update_input=...) failed in the update thread: "
                f"{type(cause).__name__}: {cause}"
            ) from cause
        if replay_error is not None:
            raise replay_error
