"""hal's graphs behind SGLang's graph-runner seams (used by ``platform.HalPlatform``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hal.errors import GraphError, UnsupportedConfigError
from hal.graph_runner import CapturedForward
from hal.metadata import AttentionMetadata
from hal.integrations.sglang.attention import HalAttnBackend
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

    Its hal backend is the attention backend's when that is hal's, else the one hal's platform
    bound (``hal_backend``); with neither it refuses.
    """

    #: The hal backend hal's platform bound (``plugin.bound_to``).
    hal_backend: Any = None

    def __init__(self, cuda_graph_runner: Any, *, enable_memory_saver: bool = False, reuse_output_buffer: bool = False) -> None:
        # reuse_output_buffer is a memory saving only: each hal graph keeps its own static outputs.
        if enable_memory_saver:
            raise UnsupportedConfigError("hal's graph backend: --enable-memory-saver is not supported")
        self._runner = cuda_graph_runner
        attn = getattr(cuda_graph_runner.model_runner, "attn_backend", None)
        # The backend whose kernels the graphs capture: the attention backend's, else the platform's.
        backend = getattr(attn, "hal_backend", None) or self.hal_backend
        if backend is None:
            raise UnsupportedConfigError(
                "hal's graph backend has no hal backend: SGLang gets it from hal's platform (SGLANG_PLATFORM=hal), "
                "or the runner's attention backend is hal's"
            )
        self._backend = backend
        if isinstance(attn, HalAttnBackend):
            attn.replayed_by_hal_graphs = True
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

        attn = self._hal_attention()

        def forward(metadata: AttentionMetadata | None) -> Any:
            # SGLang's forward reads the attention backend's metadata: the record this replay runs on
            # (a graph that re-runs Python reads each replay's; a real graph the captured tensors).
            if attn is not None and metadata is not None:
                attn.forward_metadata = metadata
            return forward_fn()

        # The metadata the attention backend set up for this shape just before is what the graph reads.
        self._captured[shape_key] = CapturedForward(self._backend, forward, self._attention_metadata(),
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

    def _hal_attention(self) -> Any:
        """The runner's attention backend when it is hal's (it then leaves each replay's refresh to
        this graph backend), else None."""
        backend = getattr(self._runner, "attn_backend", None) or self._runner.model_runner.attn_backend
        return backend if isinstance(backend, HalAttnBackend) else None

    def _attention_metadata(self) -> AttentionMetadata | None:
        """The metadata hal's attention backend prepared for this shape (None under another backend)."""
        attn = self._hal_attention()
        return None if attn is None else attn.forward_metadata

    def replay(self, shape_key: Any, static_forward_batch: Any, **kwargs: Any) -> Any:
        # The attention backend built and checked the new batch's metadata (init_forward_metadata_out_graph);
        # the captured forward takes it into its captured tensors and replays.
        return self._captured[shape_key].replay(self._attention_metadata())

    def cleanup(self) -> None:
        self._captured.clear()


class HalMultiLayerEagleDraftExtendRunner(MultiLayerEagleMultiStepDraftExtendCudaGraphRunner):
    """The multi-layer EAGLE draft-extend runner on every device hal serves: SGLang's multi-step
    runner, whose per-step graphs go through the platform's graph backend (``HalGraphBackend``)."""
