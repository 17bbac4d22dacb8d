"""The device-neutral half of graph capture: the update record and the capture span.

A ``Graph`` marks the span of its real capture (not its warm-up runs) with
``capture_span()``. Inside it, data-dependent validation (which would read device memory
and break a capture) is skipped, and attention kernels whose captured ops take host-side
parameters record each such call with ``record_updatable_call``; the graph keeps that list
as ``captured_calls``, in capture order, so a runner can ask each kernel for the new values.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

from hal.errors import GraphError

_state = threading.local()


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
    if getattr(_state, "calls", None) is not None:
        raise GraphError("graph capture is already in progress on this thread; captures do not nest")
    calls: list[tuple[Any, Any]] = []
    _state.calls = calls
    try:
        yield calls
    finally:
        _state.calls = None


def is_capturing() -> bool:
    """Whether this thread is inside ``capture_span()`` (kernels must then not read device values on the host)."""
    return getattr(_state, "calls", None) is not None


def record_updatable_call(kernel: Any, layer: Any) -> None:
    """Called by a kernel for each captured op whose host-side parameters an update must refresh."""
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
