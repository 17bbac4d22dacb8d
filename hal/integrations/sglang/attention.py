"""SGLang attention backend ``hal``: each forward's hal metadata (``forward_batch``) and the device's
hal kernel per layer, over hal's split K/V pool holding the model runner's KV."""

from __future__ import annotations

from typing import Any

import torch

import hal
from hal.errors import SpecError, UnsupportedConfigError
from hal.graph import GraphUpdate
from hal.graph_runner import refreshed_metadata
from hal.metadata import AttentionMetadata, check_metadata_against
from hal.plan import ForwardPlan
from hal.protocols import AttentionKernel, KVPool
from hal.spec import ForwardMode, LayerSpec
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
        # The metadata each captured graph reads, at fixed addresses, by (mode, batch size).
        self._captured: dict[tuple[ForwardMode, int], AttentionMetadata] = {}
        self._layer_specs: dict[tuple[int, bool], LayerSpec] = {}
        # True when hal's graph backend replays this runner's graphs: it refreshes the captured
        # metadata itself (``CapturedForward``); SGLang's own graph runners need it done here.
        self.replayed_by_hal_graphs = False
        self.forward_metadata: AttentionMetadata | None = None
        self._plan: ForwardPlan | None = None

    # -- metadata ----------------------------------------------------------------------------
    def _metadata(self, forward_batch: Any, max_pages: int | None = None, capture: bool = False) -> AttentionMetadata:
        return metadata_from_forward_batch(
            forward_batch, self.req_to_token, self.pool, max_pages=max_pages, swa_pool=self._swa_pool, window=self._window,
            capture=capture,
        )

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Eager forward: metadata built from the batch as it is."""
        if forward_batch.forward_mode.is_idle():
            self.forward_metadata = None
            return
        self.forward_metadata = self._metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Graphs capture metadata with block tables as wide as the context length."""
        self._captured.clear()

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Before a capture: the metadata the graph will read. Before a replay: the new batch's
        metadata, which hal's graph backend takes into the captured tensors (``CapturedForward``);
        under SGLang's own graph runners its values are copied into them here."""
        if forward_batch.forward_mode.is_idle():
            return
        fresh = self._metadata(forward_batch, max_pages=self._graph_max_pages, capture=in_capture)
        check_metadata_against(fresh, self.pool)  # a replay runs no plan step: checked here, before any copy
        if self.replayed_by_hal_graphs:
            self.forward_metadata = fresh  # what hal's graph backend captures, or replays on
            return
        key = (fresh.mode, fresh.batch_size)
        static = self._captured.get(key)
        if in_capture or static is None:
            self._captured[key] = self.forward_metadata = fresh
            return
        # The device tensors stay the captured ones, now holding the new batch; the record's host
        # values are the new batch's (a shape that does not fit raises GraphError, copying nothing).
        self.forward_metadata, copies = refreshed_metadata(static, fresh)
        GraphUpdate(buffer_copies=copies).apply_buffer_copies()

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

    def _forward_plan(self) -> ForwardPlan:
        """The kernel's plan for the forward running now: made at its first layer (inside the
        capture when SGLang captures the forward), shared by its other layers."""
        metadata = self.forward_metadata
        if metadata is None:
            raise SpecError("attention backend 'hal': forward before init_forward_metadata")
        if self._plan is None or not self._plan.serves(metadata, self.pool):
            self._plan = self.kernel.plan(metadata)
        return self._plan

    def _forward(self, q: torch.Tensor, k: Any, v: Any, layer: Any, forward_batch: Any, save_kv_cache: bool, sinks: Any) -> torch.Tensor:
        plan = self._forward_plan()
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
