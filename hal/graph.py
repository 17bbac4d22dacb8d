"""The device-neutral half of graph capture: the update record, the capture span, ``GraphBase``
(the template every backend's graph fills in) and ``EagerGraph`` (the graph that re-runs).

The kernel-to-graph contract (see ``hal.protocols``): a ``Graph`` marks the span of its real
capture (not its warm-up runs) with ``capture_span()``. Inside it, data-dependent validation
(which would read device memory and break a capture) is skipped, and attention kernels whose
captured ops take host-side parameters record each such call with ``record_updatable_call``;
the graph keeps that list as ``captured_calls``, in capture order, so a runner can ask each
kernel for the new values (``AttentionKernel.updatable_params``) and pass them back in
``GraphUpdate.host_params``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import attrs
import torch

from hal.errors import GraphError
from hal.spec import int_at_least

_state = threading.local()
# Capture spans open in any thread. While there are none no thread is capturing, and the checks
# below answer without reading the thread-local state (a read that costs microseconds once an
# engine's other work has left it out of the processor's caches; kernels ask on every call).
_open_spans = 0
_open_spans_lock = threading.Lock()
T = TypeVar("T")


@attrs.frozen
class GraphUpdate:
    """What changes between two replays of one captured graph.

    ``buffer_copies``: ``(static_buffer, new_value)`` pairs copied into the graph's fixed-address
    buffers before replay. ``host_params``: one mapping per captured updatable op, in capture
    order, of host-side op arguments to replace (e.g. ``actual_seq_kvlen`` on Ascend).
    """

    buffer_copies: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    host_params: tuple[Mapping[str, Any], ...] = ()

    def apply_buffer_copies(self) -> None:
        """Copy every new value into its static buffer; checks all shapes before copying any."""
        for i, (dst, src) in enumerate(self.buffer_copies):
            if dst.shape != src.shape:
                raise GraphError(
                    f"GraphUpdate copy {i}: static buffer has shape {tuple(dst.shape)}, new value {tuple(src.shape)}"
                )
        for dst, src in self.buffer_copies:
            dst.copy_(src)

    def require_no_host_params(self, graph_name: str) -> None:
        """For graphs whose kernels read only device buffers: a host update would be lost."""
        if any(self.host_params):
            keys = sorted({k for p in self.host_params for k in p})
            raise GraphError(
                f"{graph_name} cannot update host-side op parameters {keys}: its kernels read "
                "device buffers, so pass new values as buffer_copies"
            )


@contextlib.contextmanager
def capture_span() -> Iterator[list[tuple[Any, Any]]]:
    """Mark a real capture; yields the list that kernels append their updatable calls to."""
    global _open_spans
    if getattr(_state, "calls", None) is not None:
        raise GraphError("graph capture is already in progress on this thread; captures do not nest")
    calls: list[tuple[Any, Any]] = []
    with _open_spans_lock:
        _open_spans += 1
    _state.calls = calls
    try:
        yield calls
    finally:
        _state.calls = None
        with _open_spans_lock:
            _open_spans -= 1


def capture_id() -> int:
    """Identifies the capture in progress on this thread (0 outside one): what a capture records
    must not reuse tensors computed before it, which the graph would keep as constants."""
    if not _open_spans:
        return 0
    calls = getattr(_state, "calls", None)
    return 0 if calls is None else id(calls)


def is_capturing() -> bool:
    """Whether this thread is inside ``capture_span()`` (kernels must then not read device values on the host)."""
    return bool(_open_spans) and getattr(_state, "calls", None) is not None


def record_updatable_call(kernel: Any, layer: Any) -> None:
    """Called by a kernel for each captured op whose host-side parameters an update must refresh."""
    if not _open_spans:
        return
    calls = getattr(_state, "calls", None)
    if calls is not None:
        calls.append((kernel, layer))


def copy_into(dst: Any, src: Any) -> None:
    """Copy a tree (tensor / tuple / list / dict) of fresh results into the static one."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src, strict=True):
            copy_into(d, s)
    elif isinstance(dst, dict):
        for key in dst:
            copy_into(dst[key], src[key])
    elif dst is not None:
        raise GraphError(f"captured outputs must be tensors or tuples/lists/dicts of them, got {type(dst).__name__}")


class GraphBase:
    """Base class of ``Graph`` implementations: the capture/replay protocol written once.

    ``capture`` warms up (``warmup_runs`` times, ``_warm_up``), waits on ``tp_group``'s barrier so
    every tensor-parallel rank captures together, opens ``capture_span()`` around ``_capture`` and
    keeps the outputs and ``captured_calls``. ``replay`` checks the update against the capture,
    runs ``_before_update``, applies the buffer copies and calls ``_replay(host_params)``.
    A backend overrides ``_capture`` and ``_replay`` (and ``_warm_up``/``_before_update`` where
    its runtime needs them). Threading: one graph is captured and replayed by one thread at a time.
    """

    #: Whether captured ops keep host-side arguments that ``GraphUpdate.host_params`` replaces;
    #: graphs whose kernels read only device buffers refuse host updates instead of losing them.
    takes_host_params: ClassVar[bool] = False

    def __init__(self, *, warmup_runs: int = 0, tp_group: Any = None) -> None:
        self.warmup_runs = int_at_least(warmup_runs, 0, f"{type(self).__name__}.warmup_runs", GraphError)
        self.tp_group = tp_group
        self.captured_calls: list[tuple[Any, Any]] = []
        self._outputs: Any = None
        self._captured = False

    def capture(self, fn: Callable[[], T], *, memory_pool: Any = None) -> T:
        """Capture ``fn``; returns its static outputs, which every replay refreshes in place."""
        name = type(self).__name__
        if self._captured:
            raise GraphError(f"{name}.capture: this graph is already captured")
        if self.warmup_runs:
            self._warm_up(fn)
        if self.tp_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.tp_group)
        with capture_span() as calls:
            outputs = self._capture(fn, memory_pool)
        self._outputs, self.captured_calls, self._captured = outputs, list(calls), True
        return outputs

    def replay(self, update: GraphUpdate | None = None) -> None:
        """Apply ``update`` (buffer copies, then host parameters) and replay into the static outputs."""
        name = type(self).__name__
        if not self._captured:
            raise GraphError(f"{name}.replay: capture() first")
        host_params: tuple[Mapping[str, Any], ...] = ()
        if update is not None:
            if not self.takes_host_params:
                update.require_no_host_params(name)
            elif update.host_params:
                n = len(self.captured_calls)
                if len(update.host_params) != n:
                    raise GraphError(
                        f"{name}.replay: update has {len(update.host_params)} host-parameter dicts, "
                        f"the graph captured {n} calls"
                    )
                host_params = tuple(dict(p) for p in update.host_params)
        self._before_update()
        if update is not None:
            update.apply_buffer_copies()
        self._replay(host_params)

    # -- what a backend implements ----------------------------------------------------------
    def _warm_up(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` ``warmup_runs`` times before capture (lazy init, workspaces, compilation)."""
        for _ in range(self.warmup_runs):
            fn()

    def _capture(self, fn: Callable[[], T], memory_pool: Any) -> T:
        """Record ``fn`` with the runtime's graph (inside the capture span); return its outputs."""
        raise NotImplementedError(f"{type(self).__name__} must implement _capture")

    def _before_update(self) -> None:
        """Runs before the update touches any buffer (e.g. wait for the previous replay)."""

    def _replay(self, host_params: tuple[Mapping[str, Any], ...]) -> None:
        """Replay the captured work; ``host_params`` has one mapping per captured call, or is empty."""
        raise NotImplementedError(f"{type(self).__name__} must implement _replay")


class EagerGraph(GraphBase):
    """``capture`` runs ``fn`` once and keeps its outputs as the static outputs; ``replay`` re-runs
    ``fn`` (which reads the refreshed buffers) and copies the results into those outputs."""

    def __init__(self, *, tp_group: Any = None) -> None:
        super().__init__(tp_group=tp_group)
        self._fn: Callable[[], Any] | None = None

    def _capture(self, fn: Callable[[], T], memory_pool: Any) -> T:
        self._fn = fn
        return fn()

    def _replay(self, host_params: tuple[Mapping[str, Any], ...]) -> None:
        assert self._fn is not None
        copy_into(self._outputs, self._fn())
