"""SGLang attention backend ``hal``: each forward's hal metadata (``forward_batch``) and the device's
hal kernel per layer, over hal's split K/V pool holding the model runner's KV."""

from __future__ import annotations

from typing import Any

import torch

import hal
from hal.errors import SpecError, UnsupportedConfigError
from hal.metadata import AttentionMetadata, check_metadata_against
from hal.plan import ForwardPlan
from hal.protocols import AttentionKernel, KVPool
from hal.spec import LayerSpec
from hal.integrations.sglang.forward_batch import layer_spec, metadata_from_forward_batch
from hal.integrations.sglang.kv_pool import store_in_hal_pool
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend


class HalAttnBackend(AttentionBackend):
    """Attention through hal: metadata per forward, the device's hal kernel per layer.

    The model runner's KV pool keeps its KV in hal's split K/V pool (``HalMHATokenToKVPool``, or
    the in-tree pool given hal's storage when this backend starts), so no KV is copied.
    """

    def __init__(self, model_runner: Any, backend: hal.Backend) -> None:
        """``backend``: the hal backend whose pool and kernel serve this runner, resolved at the
        edge (``plugin.create_attention_backend``: the platform's, else hal's for the runner's device)."""
        super().__init__()
        if not isinstance(backend, hal.Backend):
            raise UnsupportedConfigError(f"attention backend 'hal': backend must be a hal.Backend (hal.get_backend(...)), got {backend!r}")
        self.device = torch.device(model_runner.device)
        self.hal_backend = backend
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.sgl_pool = model_runner.token_to_kv_pool
        self.pool: KVPool = store_in_hal_pool(self.sgl_pool, self.hal_backend)
        self.kernel: AttentionKernel = self.hal_backend.create_attention(self.pool)
        self.start_layer = self.sgl_pool.start_layer
        # A hybrid pool: SGLang's SWAKVPool, whose slot mapping each forward mirrors into hal's pool.
        self._swa_pool = self.sgl_pool if self.pool.spec.swa is not None else None
        self._window: int | None = getattr(model_runner, "sliding_window_size", None)
        context_len = model_runner.model_config.context_len
        self._graph_max_pages = -(-context_len // self.pool.spec.page_size)
        self._layer_specs: dict[tuple[int, bool], LayerSpec] = {}
        #: The record the layers run on and its plan (``run_on``), one per forward.
        self.forward_metadata: AttentionMetadata | None = None
        self._plan: ForwardPlan | None = None
        #: The record a graph forward is to capture or replay on (``init_forward_metadata_out_graph``):
        #: hal's graph backend (``HalGraphBackend``) hands it to ``run_on`` inside the graph.
        self.graph_metadata: AttentionMetadata | None = None

    # -- metadata ----------------------------------------------------------------------------
    def _metadata(self, forward_batch: Any, max_pages: int | None = None, capture: bool = False) -> AttentionMetadata:
        return metadata_from_forward_batch(
            forward_batch, self.req_to_token, self.pool, max_pages=max_pages, swa_pool=self._swa_pool, window=self._window,
            capture=capture,
        )

    def run_on(self, metadata: AttentionMetadata | None) -> None:
        """The layers that run next attend by ``metadata``, through the kernel's plan for it, made
        here (inside the capture when a graph captures the forward). None: no forward is set up."""
        self.forward_metadata = metadata
        self._plan = None if metadata is None else self.kernel.plan(metadata)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Eager forward: metadata built from the batch as it is, and its plan."""
        self.run_on(None if forward_batch.forward_mode.is_idle() else self._metadata(forward_batch))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Nothing to allocate: each graph hal's graph backend captures keeps the record it captured
        (block tables as wide as the context length)."""

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Before a graph captures or replays: the batch's record, checked against the pool before
        anything is copied, for hal's graph backend to hand over (``graph_metadata``). The layers
        run on nothing until it does, so a graph backend that is not hal's, which would replay
        hal's kernels on the captured batch's metadata, is refused at its first capture."""
        self.run_on(None)
        if forward_batch.forward_mode.is_idle():
            self.graph_metadata = None
            return
        fresh = self._metadata(forward_batch, max_pages=self._graph_max_pages, capture=in_capture)
        check_metadata_against(fresh, self.pool)  # a replay runs no plan step: checked here
        self.graph_metadata = fresh

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The KV length of padded rows in SGLang's captured graphs: the kernel's."""
        return self.kernel.seq_len_fill_value

    # -- forward -----------------------------------------------------------------------------
    def _layer_spec(self, layer: Any, has_sinks: bool) -> LayerSpec:
        key = (layer.layer_id, has_sinks)
        spec = self._layer_specs.get(key)
        if spec is None:
            spec = self._layer_specs[key] = layer_spec(layer, layer.layer_id - self.start_layer, has_sinks=has_sinks)
        return spec

    def _forward(self, q: torch.Tensor, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool, sinks: Any) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise UnsupportedConfigError(
                f"attention backend 'hal': layer {layer.layer_id} runs with no metadata set up. An eager forward follows "
                "init_forward_metadata; a graph's forward gets its record from hal's graph backend (SGLANG_PLATFORM=hal), "
                "and SGLang's own graph backends, which would replay hal's kernels on the captured batch's metadata, are "
                "refused: start SGLang with SGLANG_PLATFORM=hal, or with disable_cuda_graph=True"
            )
        metadata = plan.metadata
        spec = self._layer_spec(layer, sinks is not None)
        if (k is None or v is None) and save_kv_cache:
            raise SpecError(f"attention backend 'hal': layer {layer.layer_id} asks to save KV but passes k={k!r}, v={v!r}")
        rows = metadata.num_tokens
        if k is None or v is None:  # nothing to write: placeholders of the shapes the kernel checks
            k = q.new_zeros((rows, spec.num_kv_heads, spec.head_dim))
            v = q.new_zeros((rows, spec.num_kv_heads, spec.v_head_dim))
        out = self.kernel.forward(
            q.reshape(rows, spec.num_q_heads, spec.head_dim),
            k.reshape(rows, spec.num_kv_heads, spec.head_dim),
            v.reshape(rows, spec.num_kv_heads, spec.v_head_dim),
            spec,
            plan,
            save_kv_cache,
            sinks=sinks,
        )
        return out.reshape(rows, spec.num_q_heads * spec.v_head_dim)

    def forward_extend(self, q: torch.Tensor, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"))

    def forward_decode(self, q: torch.Tensor, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs.get("sinks"))
