"""``torch.npu`` emulated: streams, synchronisation, ``NPUGraph`` and ``graph(...)`` capture."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hal.backends.npu.emulator.errors import CaptureSyncError, NpuOpError
from hal.backends.npu.emulator.fia import HANDLED_OPS, check_fia_v2

# Seconds a replay waits at a handled op for its update before failing (a real device would hang).
REPLAY_WAIT_TIMEOUT_S = 30.0
SYNC_IN_CAPTURE = "Not allow to synchronize captured-stream"

_state = threading.local()  # per thread: current stream, active capture, emulated-kernel depth
_live_graphs: weakref.WeakSet[NPUGraph] = weakref.WeakSet()
_graphs_lock = threading.Lock()
_pool_ids = itertools.count(1)
_device_count = 1


class Stream:
    """An emulated stream. All work runs in order on the host, so every stream is one queue."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device
        self.priority = priority

    def synchronize(self) -> None:
        synchronize()

    def wait_stream(self, stream: Stream) -> None:
        if not isinstance(stream, Stream):
            raise TypeError(f"wait_stream expects a torch.npu.Stream, got {type(stream).__name__}")

    def __repr__(self) -> str:
        return f"<emulated torch.npu.Stream {id(self):#x}>"


_default_stream = Stream()


def current_stream(device: Any = None) -> Stream:
    stack = getattr(_state, "streams", None)
    return stack[-1] if stack else _default_stream


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """``with torch.npu.stream(s):`` makes ``s`` the current stream of this thread."""
    if s is None:
        yield
        return
    if not isinstance(s, Stream):
        raise TypeError(f"torch.npu.stream expects a torch.npu.Stream, got {type(s).__name__}")
    stack = getattr(_state, "streams", None)
    if stack is None:
        stack = _state.streams = []
    stack.append(s)
    try:
        yield
    finally:
        stack.pop()


def synchronize(device: Any = None) -> None:
    """Wait for all queued device work: every completed replay is now really finished."""
    if getattr(_state, "capture", None) is not None:
        raise CaptureSyncError(f"{SYNC_IN_CAPTURE}: torch.npu.synchronize() inside a graph capture")
    with _graphs_lock:
        for g in list(_live_graphs):
            g._unsynced_replays = 0


def is_available() -> bool:
    return True


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: the emulated device's memory is the host's."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), total


def set_device_count(count: int) -> None:
    """How many devices the emulated runtime reports (``install(device_count=...)``)."""
    global _device_count
    _device_count = count


def device_count() -> int:
    return _device_count


def current_device() -> int:
    """This thread's current device (a new thread starts on device 0, as on the device runtime)."""
    return int(getattr(_state, "device", 0))


def set_device(device: Any) -> None:
    """Make ``device`` (an index, ``"npu:<i>"`` or a ``torch.device``) this thread's current device."""
    index = device.index if isinstance(device, torch.device) else device
    if isinstance(index, str):
        index = int(index.rpartition(":")[2] or 0)
    if index is None:
        index = 0
    if not isinstance(index, int) or not 0 <= index < _device_count:
        raise NpuOpError(f"set_device: invalid device {device!r}, {_device_count} device(s) present")
    _state.device = index


def graph_pool_handle() -> tuple[int, int]:
    """An opaque memory-pool token (graphs given the same token may share memory)."""
    return (0, next(_pool_ids))


@contextlib.contextmanager
def _in_kernel() -> Iterator[None]:
    """Inside an emulated device kernel, reading device data is what the device does: allowed."""
    _state.kernel_depth = getattr(_state, "kernel_depth", 0) + 1
    try:
        yield
    finally:
        _state.kernel_depth -= 1


def _in_emulated_kernel() -> bool:
    return getattr(_state, "kernel_depth", 0) > 0


def _is_host_sync(func: Any, args: Sequence[Any]) -> bool:
    """Ops whose result (value or shape) the host must read from device memory."""
    if func is torch.ops.aten._local_scalar_dense.default or torch.Tag.data_dependent_output in func.tags:
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is torch.ops.aten.index.Tensor:  # integer indexing has a static shape; boolean masks do not
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return True


_HOST_READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.cpu})


class _HostReadGuard(TorchFunctionMode):
    """Catches host reads of device data that never reach the dispatcher (``tolist``, ``numpy``)."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        if func in _HOST_READS and not _in_emulated_kernel():
            raise CaptureSyncError(f"{SYNC_IN_CAPTURE}: Tensor.{func.__name__}() reads device data during capture")
        return func(*args, **(kwargs or {}))


def _tensors_of(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for x in tree for t in _tensors_of(x)]
    return []


def _copy_results(dst: Any, src: Any) -> None:
    for d, s in zip(_tensors_of(dst), _tensors_of(src), strict=True):
        d.copy_(s)


@attrs.define(eq=False)
class _OpRecord:
    """One op run during capture. ``kind``: view (skipped), mutating (re-run), functional (re-run, copied)."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: Any
    kind: str
    # Handled ops only: the emulated ExternalEvent, set by update() and consumed by replay(), and
    # the error of a failed update, which makes the waiting replay abort instead of hanging.
    released: threading.Event | None = None
    update_error: BaseException | None = None

    def run(self) -> None:
        if self.kind == "view":
            return
        result = self.func(*self.args, **self.kwargs)
        if self.kind != "mutating":
            _copy_results(self.outputs, result)


def _snapshot(value: Any) -> Any:
    """Host arguments are copied at capture (later edits of the caller's list must not leak in)."""
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    return value


class _CaptureRecorder(TorchDispatchMode):
    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_host_sync(func, args):
            raise CaptureSyncError(f"{SYNC_IN_CAPTURE}: {func} reads device data on the host during capture")
        with _in_kernel():
            outputs = func(*args, **kwargs)
        if func.is_view:
            kind = "view"
        elif func._schema.is_mutable:
            kind = "mutating"
        else:
            kind = "functional"
            results = outputs if isinstance(outputs, (tuple, list)) else [outputs]
            if any(x is not None and not isinstance(x, torch.Tensor) for x in results):
                raise CaptureSyncError(f"{SYNC_IN_CAPTURE}: {func} returns a host value computed from device data")
        record = _OpRecord(func, tuple(args), {k: _snapshot(v) for k, v in kwargs.items()}, outputs, kind)
        if func in HANDLED_OPS and self.graph.auto_dispatch_capture:
            record.released = threading.Event()
            self.graph._handled.append(record)
        self.graph._records.append(record)
        return outputs


class NPUGraph:
    """Emulated ``torch.npu.NPUGraph``: capture_begin/capture_end, replay, update, reset, pool."""

    def __init__(self) -> None:
        self.auto_dispatch_capture = False
        self._records: list[_OpRecord] = []
        self._handled: list[_OpRecord] = []
        self._captured = False
        self._capturing = False
        self._modes: list[Any] = []
        self._pool: Any = None
        self._unsynced_replays = 0  # replays that finished on the host but were not synchronised
        self._device = 0  # the capturing thread's current device
        with _graphs_lock:
            _live_graphs.add(self)

    # -- capture -------------------------------------------------------------------------------
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise NpuOpError(f"capture_error_mode must be 'global', 'thread_local' or 'relaxed', got {capture_error_mode!r}")
        if self._captured or self._capturing:
            raise NpuOpError("capture_begin on an NPUGraph that is already captured; call reset() first")
        if getattr(_state, "capture", None) is not None:
            raise NpuOpError("capture_begin while another NPUGraph capture is in progress on this thread")
        self._pool = pool if pool is not None else graph_pool_handle()
        self._device = current_device()
        self._capturing = True
        _state.capture = self
        self._modes = [_HostReadGuard(), _CaptureRecorder(self)]
        for mode in self._modes:
            mode.__enter__()

    def capture_end(self) -> None:
        if not self._capturing:
            raise NpuOpError("capture_end without capture_begin")
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = []
        self._capturing = False
        self._captured = True
        _state.capture = None

    def pool(self) -> Any:
        return self._pool

    def reset(self) -> None:
        self._records, self._handled = [], []
        self._captured = False

    # -- replay --------------------------------------------------------------------------------
    def replay(self) -> None:
        if not self._captured:
            raise NpuOpError("replay() before a successful capture")
        with torch.inference_mode():
            for index, record in enumerate(self._records):
                if record.released is not None:
                    self._wait_for_update(index, record)
                record.run()
        with _graphs_lock:
            self._unsynced_replays += 1

    def _wait_for_update(self, index: int, record: _OpRecord) -> None:
        assert record.released is not None
        if not record.released.wait(REPLAY_WAIT_TIMEOUT_S):
            raise NpuOpError(
                f"replay waited {REPLAY_WAIT_TIMEOUT_S}s at handled op #{index} for graph.update(): a graph "
                "captured with auto_dispatch_capture=True needs an update per replay (a device would hang)"
            )
        record.released.clear()
        error = record.update_error
        if error is not None:
            for other in self._handled:  # this replay ends here: no op after it consumes an update
                assert other.released is not None
                other.released.clear()
                other.update_error = None
            raise NpuOpError(
                f"replay aborted at handled op #{index}: graph.update() failed "
                f"({type(error).__name__}: {error}); a device would hang here"
            ) from error

    # -- update --------------------------------------------------------------------------------
    def update(self, cpu_update_input: Sequence[Mapping[str, Any]]) -> None:
        """Replace recorded host arguments of the handled ops and re-issue them (validating), in order."""
        if not self.auto_dispatch_capture or not self._captured:
            raise NpuOpError(
                "The current graph configuration does not support update, "
                "Try to capture by setting auto_dispatch_capture=True during capture"
            )
        if current_device() != self._device:
            raise NpuOpError(
                f"graph.update() on a thread whose current device is {current_device()}, but the graph was "
                f"captured on device {self._device}: call torch.npu.set_device in the updating thread first"
            )
        done = 0
        try:
            if not isinstance(cpu_update_input, (list, tuple)) or not all(
                isinstance(u, Mapping) for u in cpu_update_input
            ):
                raise TypeError("cpu_update_input must be a list of dicts (one per handled op, or one to broadcast)")
            updates = list(cpu_update_input)
            if len(updates) == 1:
                updates = updates * len(self._handled)
            if len(updates) != len(self._handled):
                raise NpuOpError(
                    f"Currently, there are {len(self._handled)} operators that need to be updated by capture, "
                    f"and there are only {len(cpu_update_input)} elements in the incoming cpu_update_input list"
                )
            with _graphs_lock:
                racing = bool(self._handled) and self._unsynced_replays > 0
            if racing:
                raise NpuOpError(
                    "graph.update() while a previous replay of this graph may still run on the device: "
                    "synchronize before updating, or the update rewrites parameters of running tasks"
                )
            for record, new in zip(self._handled, updates):
                previous = dict(record.kwargs)
                for name, value in new.items():
                    if name in record.kwargs:  # unknown keys are ignored, as torch_npu does
                        record.kwargs[name] = _snapshot(value)
                try:
                    with _in_kernel():
                        check_fia_v2(*record.args, **record.kwargs)  # the re-issue validates like a launch
                except BaseException:
                    record.kwargs = previous  # the task keeps its old parameters
                    raise
                assert record.released is not None
                record.update_error = None
                record.released.set()
                done += 1
        except BaseException as exc:
            for record in self._handled[done:]:
                assert record.released is not None
                record.update_error = exc
                record.released.set()
            raise

    @property
    def num_handled_ops(self) -> int:
        """How many FIA calls this graph recorded for update (the length ``update()`` expects)."""
        return len(self._handled)


class graph:  # noqa: N801 - mirrors torch.npu.graph
    """``with torch.npu.graph(g, pool=..., stream=..., auto_dispatch_capture=...)``: capture into ``g``."""

    default_capture_stream: Stream | None = None

    def __init__(
        self,
        npu_graph: NPUGraph,
        pool: Any = None,
        stream: Stream | None = None,
        auto_dispatch_capture: bool = False,
        capture_error_mode: str = "global",
    ) -> None:
        if not isinstance(npu_graph, NPUGraph):
            raise TypeError(f"torch.npu.graph expects an NPUGraph, got {type(npu_graph).__name__}")
        if stream is None:
            if graph.default_capture_stream is None:
                graph.default_capture_stream = Stream()
            stream = graph.default_capture_stream
        self.npu_graph = npu_graph
        self.pool = pool
        self.capture_stream = stream
        self.auto_dispatch_capture = auto_dispatch_capture
        self.capture_error_mode = capture_error_mode
        self._stream_ctx: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        synchronize()
        self._stream_ctx = stream(self.capture_stream)
        self._stream_ctx.__enter__()
        self.npu_graph.auto_dispatch_capture = self.auto_dispatch_capture
        try:
            self.npu_graph.capture_begin(self.pool, self.capture_error_mode)
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.npu_graph.capture_end()
            if exc[0] is not None:
                self.npu_graph.reset()  # a failed capture leaves nothing to replay
        finally:
            assert self._stream_ctx is not None
            self._stream_ctx.__exit__(None, None, None)
