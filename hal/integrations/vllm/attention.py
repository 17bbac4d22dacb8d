"""vLLM attention backend ``HAL``: hal metadata from vLLM's common metadata, hal's kernel per layer,
over a hal split K/V pool that is a view of the KV cache vLLM allocated.

vLLM allocates each layer's cache itself, as pages ``[blocks, heads, block_size, head_dim +
v_head_dim]`` (logical ``[B, H, N, C]``) in a layout the backend accepts, and never reads their
contents: the backend does. hal takes one layer's memory as its K plane ``[blocks, block_size,
heads, head_dim]`` followed by its V plane: block 0 is vLLM's null block and hal's padding page,
so vLLM's block ids are hal's page ids and its ``slot_mapping`` hal's ``out_cache_loc``.

Every vLLM batch, mixed prefill and decode rows, chunked prefill and prefix-cache hits included, is
hal's ``EXTEND`` (``DECODE`` when every request has one query row): request ``i`` has
``q_len = query_start_loc[i+1] - query_start_loc[i]`` new rows and ``kv_len = seq_lens[i]`` keys,
the new ones included. Speculative verify rows are such rows too (a chain, causal).

vLLM's ``sliding_window=W`` lets a query see the W most recent keys, itself included; hal's
``LayerSpec.sliding_window`` counts the keys before it, so hal's window is ``W - 1``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

import hal
from hal.errors import KVLayoutError, SpecError, UnsupportedConfigError
from hal.metadata import build_metadata
from hal.plan import ForwardPlan
from hal.protocols import AttentionKernel, KVPool
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from hal.integrations.vllm.plugin import NAME

_WHERE = f"attention backend {NAME!r}"


def edge_backend() -> hal.Backend:
    """The hal backend this process serves vLLM with: hal's platform's, else the edge's for vLLM
    (``hal.integrations.edge``; the device vLLM's platform runs on when ``HAL_VLLM_DEVICE`` names
    none). Both are resolved once per process."""
    from vllm.platforms import current_platform

    from hal.integrations.edge import edge_backend as resolve

    backend = getattr(current_platform, "hal_backend", None)
    if isinstance(backend, hal.Backend):
        return backend
    return resolve("vllm", engine_device=current_platform.device_type)


def layer_planes(kv_cache: torch.Tensor, spec: KVPoolSpec, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """hal's (K, V) buffers over one layer's vLLM cache: its memory, dense, as a K plane then a V
    plane; a cache whose pages are not one dense run (padded pages, a layout that interleaves
    layers) is refused by name."""
    blocks = spec.num_pages + 1
    elems = blocks * spec.page_size * spec.kv_heads * (spec.head_dim + spec.v_head_dim)
    dense = kv_cache.numel() == elems and _is_dense(kv_cache)
    if not dense:
        raise KVLayoutError(
            f"{_WHERE}: layer {name}'s KV cache is {tuple(kv_cache.shape)} with strides {kv_cache.stride()}; hal views "
            f"a layer as {elems} dense elements ({blocks} blocks of {spec.page_size} tokens x {spec.kv_heads} heads x "
            f"({spec.head_dim} + {spec.v_head_dim})): use a layer-compact layout without page padding"
        )
    flat = torch.as_strided(kv_cache, (elems,), (1,), kv_cache.storage_offset())
    k_elems = blocks * spec.page_size * spec.kv_heads * spec.head_dim
    k = flat[:k_elems].view(blocks, spec.page_size, spec.kv_heads, spec.head_dim)
    v = flat[k_elems:].view(blocks, spec.page_size, spec.kv_heads, spec.v_head_dim)
    return k, v


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one contiguous run in some order of its dims."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class HalAttentionBackend(AttentionBackend):
    """hal's attention for vLLM: the kernel of the edge's hal backend (``edge_backend``)."""

    # hal's forward validates, writes the new K/V, then attends: one call, nothing written on refusal.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @classmethod
    def set_head_size_v(cls, head_size_v: int) -> None:
        """What vLLM's diff-KV backends take from a model before its layers are built (MiMo-V2-Flash
        calls it); hal reads each layer's ``head_size_v`` from the layer itself, so this records nothing."""

    @classmethod
    def is_supported_on_current_device(cls, head_size: int, head_size_v: int, has_sinks: bool = False) -> bool:
        """Asked by a model choosing among vLLM's diff-KV backends (which hal's platform maps to this
        one, ``plugin.MODEL_CHOSEN_BACKENDS``): yes, and what the edge's kernel cannot take is refused
        when the layer's pool and kernel are built."""
        return True

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[HalAttentionImpl]:
        return HalAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[HalMetadataBuilder]:
        return HalMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Layer-compact layouts: each layer's pages are one dense run hal can view as K and V planes.
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@attrs.frozen
class HalForwardMetadata:
    """What every layer of a KV-cache group reads in one forward: the kernel's plan for the batch."""

    plan: ForwardPlan
    kernel: AttentionKernel
    #: vLLM layer name -> the layer's index in the group's hal pool.
    pool_layers: dict[str, int]
    num_actual_tokens: int


class HalMetadataBuilder(AttentionMetadataBuilder[HalForwardMetadata]):
    """One per KV-cache group: its hal pool (a view of the group's layer caches, made at the first
    batch, when vLLM has bound them) and kernel, and each batch's hal metadata and plan."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.vllm_config = vllm_config
        self.backend = edge_backend()
        self.pool_layers = {name: i for i, name in enumerate(layer_names)}
        self.pool: KVPool | None = None
        self.kernel: AttentionKernel | None = None

    def _pool_spec(self, layers: dict[str, Any]) -> KVPoolSpec:
        spec = self.kv_cache_spec
        v_dim = getattr(spec, "head_size_v", None) or spec.head_size
        if getattr(spec, "page_size_padded", None) is not None:
            raise KVLayoutError(f"{_WHERE}: padded KV pages (page_size_padded={spec.page_size_padded}) are not stored by hal's pool")
        blocks = {int(layer.kv_cache.shape[0]) for layer in layers.values()}
        if len(blocks) != 1:
            raise KVLayoutError(f"{_WHERE}: the group's layers hold {sorted(blocks)} blocks; hal's pool gives every layer the same")
        (num_blocks,) = blocks
        return KVPoolSpec(
            num_layers=len(self.layer_names), size=(num_blocks - 1) * spec.block_size, page_size=spec.block_size,
            kv_heads=spec.num_kv_heads, head_dim=spec.head_size, v_head_dim=v_dim, dtype=spec.dtype,
        )

    def _pool_and_kernel(self) -> tuple[KVPool, AttentionKernel]:
        if self.pool is not None and self.kernel is not None:
            return self.pool, self.kernel
        layers = get_layers_from_vllm_config(self.vllm_config, Attention, self.layer_names)
        missing = [name for name in self.layer_names if name not in layers]
        if missing:
            raise UnsupportedConfigError(f"{_WHERE}: layers {missing} of the KV-cache group are not attention layers hal serves")
        spec = self._pool_spec(layers)
        _check_shared_caches(self.vllm_config, spec, self.layer_names)
        storage = [layer_planes(layers[name].kv_cache, spec, name) for name in self.layer_names]
        self.pool = self.backend.create_kv_pool(spec, storage=storage)
        self.kernel = self.backend.create_attention(self.pool)
        return self.pool, self.kernel

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False) -> HalForwardMetadata:
        cm = common_attn_metadata
        if not (cm.causal is True):
            raise UnsupportedConfigError(f"{_WHERE}: a non-causal batch (causal={cm.causal!r}); hal runs causal decoder attention")
        pool, kernel = self._pool_and_kernel()
        b, n = cm.num_reqs, cm.num_actual_tokens
        starts = _leading(cm.query_start_loc_cpu, b + 1).tolist()
        q_lens = [hi - lo for lo, hi in zip(starts, starts[1:])]
        kv_lens = _leading(cm.seq_lens, b).tolist()  # the forward's one read of device lengths
        if sum(q_lens) != n:
            raise SpecError(f"{_WHERE}: query_start_loc counts {sum(q_lens)} rows, num_actual_tokens is {n}")
        mode = ForwardMode.DECODE if max(q_lens, default=0) == 1 else ForwardMode.EXTEND
        metadata = build_metadata(
            mode, kv_lens=kv_lens, q_lens=q_lens, page_table=_leading(cm.block_table_tensor, b),
            out_cache_loc=_leading(cm.slot_mapping, n), pool=pool,
        )
        return HalForwardMetadata(plan=kernel.plan(metadata), kernel=kernel, pool_layers=self.pool_layers, num_actual_tokens=n)


def _leading(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` rows of ``t``: ``t`` itself when it has ``n`` (vLLM hands its buffers already
    cut to the batch; a slice is a torch op, and a step's build runs with the processor's caches
    full of the model's data, where each kind of op costs microseconds)."""
    return t if t.shape[0] == n else t[:n]


def block_geometry(blocks: int, kv_heads: int, block_size: int, head_dim: int, v_head_dim: int) -> tuple[int, int, int]:
    """What decides where hal's planes put a layer's block ``b``: the block count and the K and V
    elements one block holds. Layers sharing one KV tensor agree on every block when these agree."""
    return int(blocks), block_size * kv_heads * head_dim, block_size * kv_heads * v_head_dim


def _check_shared_caches(vllm_config: VllmConfig, spec: KVPoolSpec, layer_names: list[str]) -> None:
    """vLLM may back layers of different KV-cache groups with one tensor (one block id belongs to
    one group at a time), evening out their pages by block size (MiMo-V2-Flash's full layers, with
    half the SWA layers' KV heads, get blocks of twice the tokens). hal's planes put block ``b``'s K
    at ``b`` K-blocks into the K plane and its V at ``b`` V-blocks into the V plane, so sharers agree
    when their blocks hold as many K and as many V elements; a sharer that does not is refused by name."""
    ours = set(layer_names)
    everyone = get_layers_from_vllm_config(vllm_config, Attention)
    mine = {everyone[name].kv_cache.data_ptr(): name for name in layer_names if name in everyone}
    block = block_geometry(spec.num_pages + 1, spec.kv_heads, spec.page_size, spec.head_dim, spec.v_head_dim)
    for name, layer in everyone.items():
        if name in ours or layer.kv_cache.numel() == 0:
            continue
        sharer = mine.get(layer.kv_cache.data_ptr())
        if sharer is None:
            continue
        blocks, heads, tokens = layer.kv_cache.shape[:3]  # logical [blocks, heads, block_size, head_dim + v_head_dim]
        theirs = block_geometry(blocks, heads, tokens, layer.head_size, layer.head_size_v)
        if theirs != block:
            raise KVLayoutError(
                f"{_WHERE}: vLLM backs layers {sharer} and {name} with one KV tensor, but their (blocks, K elements per "
                f"block, V elements per block) are {block} and {theirs}; hal's K/V planes would place their blocks differently"
            )


class HalAttentionImpl(AttentionImpl):
    """One vLLM attention layer run by hal's kernel. What hal does not compute is refused here, at
    model construction, by name."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported: Any,
    ) -> None:
        refusals = {
            "alibi_slopes": alibi_slopes is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "attn_type": attn_type != AttentionType.DECODER,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None,
            "kv_cache_dtype": kv_cache_dtype != "auto",
            **{key: True for key in unsupported},
        }
        refused = {key: value for key, value in dict(
            alibi_slopes=alibi_slopes, logits_soft_cap=logits_soft_cap, attn_type=attn_type,
            kv_sharing_target_layer_name=kv_sharing_target_layer_name, kv_cache_dtype=kv_cache_dtype, **unsupported,
        ).items() if refusals[key]}
        if refused:
            raise UnsupportedConfigError(
                f"{_WHERE}: {refused} is not served; hal runs causal decoder attention over an unquantized KV cache "
                "(no ALiBi, logit soft-cap or KV sharing)"
            )
        if sliding_window is not None and sliding_window < 1:
            raise UnsupportedConfigError(f"{_WHERE}: sliding_window={sliding_window}; expected None or a window of >= 1 keys")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = None if sliding_window is None else sliding_window - 1  # hal counts the keys before the query
        self.sinks = sinks
        self._specs: dict[str, LayerSpec] = {}

    def _layer_spec(self, layer: Any, metadata: HalForwardMetadata) -> LayerSpec:
        spec = self._specs.get(layer.layer_name)
        if spec is None:
            spec = self._specs[layer.layer_name] = LayerSpec(
                layer_id=metadata.pool_layers[layer.layer_name], num_q_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, v_head_dim=layer.head_size_v, scaling=self.scale, sliding_window=self.sliding_window,
                has_sinks=self.sinks is not None,
            )
        return spec

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: HalForwardMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedConfigError(f"{_WHERE}: fused output quantization is not served")
        if attn_metadata is None:  # vLLM's profiling run: no KV cache yet
            return output
        spec = self._layer_spec(layer, attn_metadata)
        n = attn_metadata.num_actual_tokens
        if query.shape[0] != n:  # rows past the batch's tokens (padding): not attended
            query, key, value = query[:n], key[:n], value[:n]
        rows = output if output.shape[0] == n else output[:n]
        attn_metadata.kernel.forward(
            _by_heads(query, spec.num_q_heads, spec.head_dim),
            _by_heads(key, spec.num_kv_heads, spec.head_dim),
            _by_heads(value, spec.num_kv_heads, spec.v_head_dim),
            spec,
            attn_metadata.plan,
            sinks=self.sinks,
            out=_by_heads(rows, spec.num_q_heads, spec.v_head_dim),  # vLLM's output rows: written in place
        )
        return output


def _by_heads(rows: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """``[T, heads, dim]`` rows as they are (vLLM's layer passes them so), ``[T, heads * dim]`` ones viewed so;
    a shape that fits neither is the kernel's to refuse by name."""
    return rows if rows.dim() != 2 else rows.view(rows.shape[0], heads, dim)
