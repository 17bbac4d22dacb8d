"""Eager ``Graph``: the same capture/update/replay contract, re-running the function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hal.errors import GraphError
from hal.graph import GraphUpdate, capture_span, copy_into

T = TypeVar("T")


class EagerGraph:
    """``capture`` runs ``fn`` once and keeps its outputs as the static outputs; ``replay`` applies
    the update's buffer copies, runs ``fn`` again and copies the results into those outputs."""

    def __init__(self) -> None:
        self._fn: Callable[[], Any] | None = None
        self._outputs: Any = None
        self.captured_calls: list = []

    def capture(self, fn: Callable[[], T], *, pool: Any = None) -> T:
        if self._fn is not None:
            raise GraphError("EagerGraph.capture: this graph is already captured")
        with capture_span() as calls:
            outputs = fn()
        self._fn, self._outputs, self.captured_calls = fn, outputs, calls
        return outputs

    def replay(self, update: GraphUpdate | None = None) -> None:
        if self._fn is None:
            raise GraphError("EagerGraph.replay: capture() first")
        if update is not None:
            update.require_no_host_params("EagerGraph")
            update.apply_buffer_copies()
        copy_into(self._outputs, self._fn())
