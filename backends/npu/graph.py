"""``Graph`` on Ascend: ``torch.npu.NPUGraph`` with auto-dispatch capture and host-parameter updates.

A captured FIA call bakes its host arguments (``actual_seq_kvlen``...) into the graph task. Each
replay therefore re-issues them with ``graph.update(cpu_update_input=[...])`` on a worker thread
while ``graph.replay()`` runs on the caller's thread: the replay's device stream waits at every
captured FIA op until the update for it has landed. Any exception of the update thread is raised
in the caller, since a lost update means attention over stale lengths.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from hal.backends.npu.runtime import NpuRuntime
from hal.sdk import GraphBase, GraphError

T = TypeVar("T")


class NpuGraph(GraphBase):
    """Capture ``fn`` once into an NPUGraph; ``replay(update)`` refreshes buffers and host params."""

    takes_host_params = True

    def __init__(self, runtime: NpuRuntime, *, stream: Any = None, tp_group: Any = None, warmup_runs: int = 2) -> None:
        if not isinstance(runtime, NpuRuntime):
            raise GraphError(f"NpuGraph: runtime must be an NpuRuntime (its backend's), got {type(runtime).__name__}")
        super().__init__(warmup_runs=warmup_runs, tp_group=tp_group)
        self.runtime = runtime
        self._stream = stream
        self._graph: Any = None
        self._device_index = 0  # the device the graph was captured on

    def _capture_stream(self) -> Any:
        if self._stream is None:
            self._stream = self.runtime.npu.Stream()
        return self._stream

    def _warm_up(self, fn: Callable[[], Any]) -> None:
        npu = self.runtime.npu
        stream = self._capture_stream()
        stream.wait_stream(npu.current_stream())
        with npu.stream(stream):  # lazy init, workspace sizing, full eager validation
            super()._warm_up(fn)
        npu.synchronize()

    def _capture(self, fn: Callable[[], T], memory_pool: Any) -> T:
        npu = self.runtime.npu
        graph = npu.NPUGraph()
        with npu.graph(graph, pool=memory_pool, stream=self._capture_stream(), auto_dispatch_capture=True):
            outputs = fn()
        self._graph, self._device_index = graph, npu.current_device()
        return outputs

    def _before_update(self) -> None:
        # The previous replay must be done before its captured ops' parameters are rewritten.
        self.runtime.npu.synchronize()

    def _replay(self, host_params: tuple[Mapping[str, Any], ...]) -> None:
        graph, device_index, npu = self._graph, self._device_index, self.runtime.npu
        # One dict per captured FIA op; an empty update re-issues the ops unchanged.
        update_input = [dict(p) for p in host_params] or [{}]
        failures: list[BaseException] = []

        def push_update() -> None:
            try:
                npu.set_device(device_index)  # a new thread starts on device 0, not the graph's device
                graph.update(cpu_update_input=update_input)
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
