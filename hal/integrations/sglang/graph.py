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
    """SGLang's per-shape graph backend on hal's graphs (NPUGraph, CUDA graph or eager): the one
    way SGLang captures and replays hal's attention.

    Each shape is one ``hal.graph_runner.CapturedForward`` over the record hal's attention backend
    prepared for it (``HalAttnBackend.graph_metadata``), handed to the layers inside the graph
    (``HalAttnBackend.run_on``). A replay takes the new batch's record into the captured tensors
    and hands the host-side arguments hal's kernels recorded at capture (FIA's
    ``actual_seq_kvlen`` on Ascend) to the graph, so no replay runs on stale lengths.

    Its hal backend is the one hal's platform bound (``plugin.bound_to``); an attention backend of
    hal's on another hal backend is refused, as is a graph backend that no platform bound.
    """

    #: The hal backend hal's platform bound (``plugin.bound_to``).
    hal_backend: Any = None

    def __init__(self, cuda_graph_runner: Any, *, enable_memory_saver: bool = False, reuse_output_buffer: bool = False) -> None:
        # reuse_output_buffer is a memory saving only: each hal graph keeps its own static outputs.
        if enable_memory_saver:
            raise UnsupportedConfigError("hal's graph backend: --enable-memory-saver is not supported")
        if self.hal_backend is None:
            raise UnsupportedConfigError(
                "hal's graph backend has no hal backend: SGLang gets it bound from hal's platform (SGLANG_PLATFORM=hal)"
            )
        self._runner = cuda_graph_runner
        self._backend = self.hal_backend
        attn = self._hal_attention()
        if attn is not None and attn.hal_backend is not self._backend:
            raise UnsupportedConfigError(
                f"hal's graph backend captures on {self._backend!r}, but the runner's attention backend serves "
                f"{attn.hal_backend!r}: both come from the one hal backend hal's platform serves with"
            )
        self._captured: dict[Any, CapturedForward] = {}
        self._memory_pool: Any = None

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        if self._memory_pool is None:
            self._memory_pool = self._backend.graph_memory_pool()
        yield

    def capture_one(self, shape_key: Any, forward_fn: Any, capture_inputs: Any = None, post_warmup_hook: Any = None) -> None:
        attn = self._hal_attention()

        def forward(metadata: AttentionMetadata | None) -> Any:
            # The layers run on the record this capture or replay is for, planned inside the graph.
            if attn is not None:
                attn.run_on(metadata)
            return forward_fn()

        record = self._graph_metadata()

        def warm_up() -> None:  # lazy initialisation and workspaces happen before capture
            for _ in range(2):
                forward(record)
                if post_warmup_hook is not None:
                    post_warmup_hook()

        self._captured[shape_key] = CapturedForward(self._backend, forward, record, memory_pool=self._memory_pool, warm_up=warm_up)

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

    def _hal_attention(self) -> HalAttnBackend | None:
        """The runner's attention backend when it is hal's, else None (a forward that reads no hal metadata)."""
        backend = getattr(self._runner, "attn_backend", None) or self._runner.model_runner.attn_backend
        return backend if isinstance(backend, HalAttnBackend) else None

    def _graph_metadata(self) -> AttentionMetadata | None:
        """The record hal's attention backend prepared for the shape SGLang captures or replays now."""
        attn = self._hal_attention()
        return None if attn is None else attn.graph_metadata

    def replay(self, shape_key: Any, static_forward_batch: Any, **kwargs: Any) -> Any:
        # The attention backend built and checked the new batch's record (init_forward_metadata_out_graph);
        # the captured forward takes it into its captured tensors and host arguments, and replays.
        return self._captured[shape_key].replay(self._graph_metadata())

    def cleanup(self) -> None:
        self._captured.clear()


class HalMultiLayerEagleDraftExtendRunner(MultiLayerEagleMultiStepDraftExtendCudaGraphRunner):
    """The multi-layer EAGLE draft-extend runner on every device hal serves: SGLang's multi-step
    runner, whose per-step graphs go through the platform's graph backend (``HalGraphBackend``)."""
