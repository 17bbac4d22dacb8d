"""hal's graphs behind SGLang's graph-runner seams (used by ``platform.HalPlatform``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hal.errors import GraphError, UnsupportedConfigError
from hal.graph_runner import CapturedForward
from hal.metadata import AttentionMetadata
from hal.integrations.sglang.kv_pool import serving_backend
from sglang.srt.model_executor.runner_backend.base_cuda_graph_backend import BaseCudaGraphBackend
from sglang.srt.speculative.multi_layer_eagle_draft_extend_cuda_graph_runner import (
    MultiLayerEagleMultiStepDraftExtendCudaGraphRunner,
)


class HalGraphBackend(BaseCudaGraphBackend):
    """SGLang's per-shape graph backend on hal's graphs (NPUGraph, CUDA graph or eager).

    Each shape is one ``hal.graph_runner.CapturedForward``. Before each replay the attention
    backend has refreshed its captured metadata; the host-side arguments hal's kernels recorded at
    capture (FIA's ``actual_seq_kvlen`` on Ascend) are then taken from that metadata and handed to
    the graph, so no replay runs on stale lengths.
    """

    def __init__(self, cuda_graph_runner: Any, *, enable_memory_saver: bool = False, reuse_output_buffer: bool = False) -> None:
        # reuse_output_buffer is a memory saving only: each hal graph keeps its own static outputs.
        if enable_memory_saver:
            raise UnsupportedConfigError("hal's graph backend: --enable-memory-saver is not supported")
        self._runner = cuda_graph_runner
        attn = getattr(cuda_graph_runner.model_runner, "attn_backend", None)
        # The backend whose kernels the graphs capture: the attention backend's, else the serving one.
        self._backend = getattr(attn, "hal_backend", None) or serving_backend(cuda_graph_runner.model_runner.device)
        self._captured: dict[Any, CapturedForward] = {}
        self._memory_pool: Any = None

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        if self._memory_pool is None:
            self._memory_pool = self._backend.graph_memory_pool()
        yield

    def capture_one(self, shape_key: Any, forward_fn: Any, capture_inputs: Any = None, post_warmup_hook: Any = None) -> None:
        def warm_up() -> None:  # lazy initialisation and workspaces happen before capture
            for _ in range(2):
                forward_fn()
                if post_warmup_hook is not None:
                    post_warmup_hook()

        # SGLang's forward reads the attention backend's metadata, set up for this shape just before.
        self._captured[shape_key] = CapturedForward(self._backend, lambda metadata: forward_fn(), self._attention_metadata(),
                                                    memory_pool=self._memory_pool, warm_up=warm_up)

    def captured(self, shape_key: Any) -> Any:
        """The hal graph captured for ``shape_key`` (``GraphError`` if none)."""
        try:
            return self._captured[shape_key].graph
        except KeyError:
            raise GraphError(f"hal's graph backend: nothing captured for {shape_key!r}; captured: {sorted(map(repr, self._captured))}") from None

    def can_run(self, forward_batch: Any, shape_key: Any) -> bool:
        return shape_key in self._captured

    @contextlib.contextmanager
    def replay_session(self) -> Iterator[None]:
        yield

    def _attention_metadata(self) -> AttentionMetadata | None:
        """The metadata hal's attention backend prepared for this shape (None under another backend)."""
        backend = getattr(self._runner, "attn_backend", None) or self._runner.model_runner.attn_backend
        return getattr(backend, "forward_metadata", None)

    def replay(self, shape_key: Any, static_forward_batch: Any, **kwargs: Any) -> Any:
        # The attention backend refreshed its captured metadata (init_forward_metadata_out_graph).
        return self._captured[shape_key].replay_refreshed(self._attention_metadata())

    def cleanup(self) -> None:
        self._captured.clear()


class HalMultiLayerEagleDraftExtendRunner(MultiLayerEagleMultiStepDraftExtendCudaGraphRunner):
    """The multi-layer EAGLE draft-extend runner on every device hal serves: SGLang's multi-step
    runner, whose per-step graphs go through the platform's graph backend (``HalGraphBackend``)."""
