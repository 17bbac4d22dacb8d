"""``HalGraphBackend``: SGLang's per-shape graph protocol on hal's graphs. On the CPU hal's graph
re-runs the captured function, so a replay must reflect the inputs as they are at replay time."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

from hal.errors import GraphError, UnsupportedConfigError  # noqa: E402
from hal.integrations.sglang.graph import HalGraphBackend  # noqa: E402


def make_backend(metadata: object = None) -> HalGraphBackend:
    runner = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(device="cpu", attn_backend=types.SimpleNamespace(forward_metadata=metadata)),
    )
    return HalGraphBackend(runner)


def test_capture_then_replay_reads_the_static_inputs() -> None:
    backend = make_backend()
    static_input = torch.arange(4.0)
    warmups = []
    with backend.capture_session(stream=None):
        backend.capture_one("bs4", lambda: static_input * 2, post_warmup_hook=lambda: warmups.append(1))
    assert len(warmups) == 2 and backend.can_run(None, "bs4") and not backend.can_run(None, "bs8")
    static_input.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))  # what SGLang's runner does before a replay
    with backend.replay_session():
        out = backend.replay("bs4", static_forward_batch=None)
    assert out.tolist() == [10.0, 12.0, 14.0, 16.0]
    backend.cleanup()
    assert not backend.can_run(None, "bs4")


def test_memory_saver_is_refused() -> None:
    runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(device="cpu"))
    with pytest.raises(UnsupportedConfigError, match="memory-saver"):
        HalGraphBackend(runner, enable_memory_saver=True)


def test_replay_of_a_graph_with_host_arguments_needs_metadata() -> None:
    """A graph that recorded updatable kernel calls cannot replay without fresh metadata."""
    backend = make_backend(metadata=None)
    with backend.capture_session(stream=None):
        backend.capture_one("bs1", lambda: torch.zeros(1))
    backend._graphs["bs1"].captured_calls.append((object(), object()))
    with pytest.raises(GraphError, match="no metadata"):
        backend.replay("bs1", static_forward_batch=None)
