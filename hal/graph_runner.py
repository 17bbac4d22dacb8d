"""A device-neutral graph runner over any ``Graph``: padded batch sizes, updates, eager fallback."""

from __future__ import annotations

import bisect
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from hal.errors import BatchTooLargeError, GraphError, SpecError
from hal.graph import GraphUpdate
from hal.metadata import AttentionMetadata, build_metadata, check_metadata_against
from hal.protocols import AttentionKernel, Backend, Graph
from hal.spec import ForwardMode, int_at_least
from hal.tree import chain_tree_mask

Forward = Callable[[Mapping[str, torch.Tensor], AttentionMetadata], Any]


BufferCopies = tuple[tuple[torch.Tensor, torch.Tensor], ...]


def refreshed_metadata(static: AttentionMetadata, new: AttentionMetadata) -> tuple[AttentionMetadata, BufferCopies]:
    """What a captured forward reads for the batch ``new``: the record over ``static``'s device
    tensors (the addresses the graph captured) with ``new``'s host values, and the copies that put
    ``new``'s device values into those tensors. A batch whose tensors differ in shape is a
    ``GraphError`` naming the tensor, before any record or copy is made."""
    if new.mode != static.mode or new.page_size != static.page_size:
        raise GraphError(f"captured {static.mode.name} metadata (pages of {static.page_size}) cannot take "
                         f"{new.mode.name} metadata (pages of {new.page_size})")
    values = new.tensors()
    static_tensors = static.tensors()
    if set(values) != set(static_tensors):
        raise GraphError(f"captured metadata holds {sorted(static_tensors)}, the new batch's {sorted(values)}")
    for name, tensor in static_tensors.items():
        if values[name].shape != tensor.shape:
            raise GraphError(f"captured metadata's {name} has shape {tuple(tensor.shape)}, the new batch's "
                             f"{tuple(values[name].shape)}: it needs a graph captured for that shape")
    copies = tuple((tensor, values[name]) for name, tensor in static_tensors.items())
    record = attrs.evolve(static, kv_lens_cpu=new.kv_lens_cpu, q_lens_cpu=new.q_lens_cpu,
                          out_cache_loc_host=new.out_cache_loc_host, block_table_host=new.block_table_host,
                          tree_mask_host=new.tree_mask_host)
    return record, copies


def graph_update(graph: Graph, metadata: AttentionMetadata, copies: BufferCopies = ()) -> GraphUpdate:
    """The update that replays ``graph`` on ``metadata``: ``copies``, and the host arguments of every
    call the graph captured (``updatable_params``: FIA's lengths on Ascend) for that metadata."""
    return GraphUpdate(buffer_copies=copies,
                       host_params=tuple(kernel.updatable_params(metadata, layer) for kernel, layer in graph.captured_calls))


class CapturedForward:
    """One forward captured on a backend's graph: the static metadata record it reads, the graph
    and its static outputs. ``forward(metadata)`` is captured reading ``current``, the record of
    the latest ``refresh`` (a graph that re-runs its function sees each batch's record; a real
    graph reads the static tensors, which ``refresh``'s update rewrites). ``tp_group`` is the
    tensor-parallel group whose barrier the capture waits on; ``warm_up`` runs before the graph
    is made. ``metadata`` None: a forward that reads no hal metadata (it records no hal kernel
    call, so its replays take no host arguments). Used by ``GraphRunner`` and by the SGLang graph
    backend."""

    def __init__(
        self,
        backend: Backend,
        forward: Callable[[AttentionMetadata | None], Any],
        metadata: AttentionMetadata | None,
        *,
        memory_pool: Any = None,
        tp_group: Any = None,
        warm_up: Callable[[], None] | None = None,
    ) -> None:
        self.metadata = self.current = metadata
        if warm_up is not None:
            warm_up()
        self.graph: Graph = backend.create_graph(tp_group=tp_group)
        self.outputs = self.graph.capture(lambda: forward(self.current), memory_pool=memory_pool)

    def refresh(self, new: AttentionMetadata, copies: BufferCopies = ()) -> GraphUpdate:
        """The update for a replay on ``new`` (plus ``copies`` of other static inputs); ``current``
        becomes ``new``'s record over the static tensors."""
        if self.metadata is None:
            raise GraphError("CapturedForward.refresh: this forward was captured without metadata")
        self.current, metadata_copies = refreshed_metadata(self.metadata, new)
        return graph_update(self.graph, self.current, copies + metadata_copies)

    def replay(self, new: AttentionMetadata | None, copies: BufferCopies = ()) -> Any:
        """Replay on ``new`` (None: a forward captured without metadata); the static outputs."""
        if new is None:
            if self.metadata is not None or self.graph.captured_calls:
                raise GraphError("CapturedForward.replay: the forward was captured reading hal metadata, and no "
                                 "metadata was given for this replay")
            self.graph.replay(GraphUpdate(buffer_copies=copies) if copies else None)
            return self.outputs
        self.graph.replay(self.refresh(new, copies))
        return self.outputs


@attrs.define
class _Captured:
    forward: CapturedForward
    inputs: dict[str, torch.Tensor]


def _slice_rows(tree: Any, rows: int) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree[:rows]
    if isinstance(tree, tuple):
        return tuple(_slice_rows(t, rows) for t in tree)
    if isinstance(tree, list):
        return [_slice_rows(t, rows) for t in tree]
    if isinstance(tree, dict):
        return {k: _slice_rows(v, rows) for k, v in tree.items()}
    return tree


class GraphRunner:
    """Captures ``forward`` at several padded batch sizes and replays the smallest that fits.

    ``forward(inputs, metadata)`` must return a tensor (or tuple/list/dict of tensors) whose first
    dim is the token count; ``run`` returns those rows for the real requests only. The returned
    tensors are views of the graph's static outputs, valid until the next ``run``.
    Batches above the largest captured size run eagerly (or raise, with ``eager_fallback=False``).
    ``replay_captured`` (default: ``backend.captures_graphs``) False runs every batch eagerly at its
    real size, with the same checks, for backends whose graphs re-run Python anyway.
    ``tp_group``: the tensor-parallel process group; each graph waits on its barrier before capture.
    ``trees``: the runner takes ``TARGET_VERIFY`` batches over draft trees (each with a ``tree_mask``)
    instead of chains.

    The replay path refuses what the eager path refuses, before anything is copied into the
    graph's static buffers: metadata is checked against the pool (slot and page ids), inputs
    against their declared shape, dtype and device. Threading: the static buffers serve one call
    at a time; a second thread calling ``run`` while one is running gets ``GraphError``.
    """

    def __init__(
        self,
        backend: Backend,
        forward: Forward,
        *,
        attention: AttentionKernel,
        mode: ForwardMode,
        tokens_per_request: int,
        batch_sizes: Sequence[int],
        max_pages_per_request: int,
        inputs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        seq_len_fill_value: int | None = None,
        eager_fallback: bool = True,
        replay_captured: bool | None = None,
        tp_group: Any = None,
        trees: bool = False,
    ) -> None:
        if not isinstance(mode, ForwardMode):
            raise SpecError(f"GraphRunner: mode must be a hal.ForwardMode, got {mode!r}")
        if not mode.has_uniform_query_len() or mode.is_idle():
            raise SpecError(f"GraphRunner: {mode.name} has no fixed per-request shape to capture")
        tokens_per_request = int_at_least(tokens_per_request, 1, "GraphRunner.tokens_per_request")
        max_pages_per_request = int_at_least(max_pages_per_request, 1, "GraphRunner.max_pages_per_request")
        if trees and not mode.is_target_verify():
            raise SpecError(f"GraphRunner: trees=True captures TARGET_VERIFY forwards over draft trees, got {mode.name}")
        if mode.is_decode() and tokens_per_request != 1:
            raise SpecError(f"GraphRunner: DECODE has 1 token per request, got tokens_per_request={tokens_per_request}")
        sizes = sorted(set(int_at_least(b, 1, "GraphRunner.batch_sizes entry") for b in batch_sizes))
        if not sizes:
            raise SpecError("GraphRunner.batch_sizes is empty: give at least one batch size to capture")
        self.backend = backend
        self.forward = forward
        self.attention = attention
        self.mode = mode
        self.tokens_per_request = tokens_per_request
        self.batch_sizes = sizes
        self.max_pages_per_request = max_pages_per_request
        self.fill = attention.seq_len_fill_value if seq_len_fill_value is None else seq_len_fill_value
        # kv_lens include the new tokens, so a padded request's first token sees at least itself
        int_at_least(self.fill, 1, "GraphRunner: seq_len_fill_value")
        self.eager_fallback = eager_fallback
        self.tp_group = tp_group
        self.trees = trees
        # A graph that re-runs its function saves nothing on replay: padding the batch and copying
        # it into static buffers would only add work, so such backends run batches eagerly.
        self.replay_captured = getattr(backend, "captures_graphs", True) if replay_captured is None else bool(replay_captured)
        device = attention.pool.device
        rows = sizes[-1] * tokens_per_request
        self._static_inputs = {
            name: torch.zeros((rows, *shape), dtype=dtype, device=device) for name, (shape, dtype) in inputs.items()
        }
        self._captured: dict[int, _Captured] = {}
        self._capture_done = False
        self._running = threading.Lock()

    def captured(self, batch_size: int) -> CapturedForward:
        """The forward captured for ``batch_size`` (``GraphError`` if none)."""
        entry = self._captured.get(batch_size)
        if entry is None:
            raise GraphError(f"GraphRunner: nothing captured for batch size {batch_size}; captured: {sorted(self._captured)}")
        return entry.forward

    @property
    def max_batch_size(self) -> int:
        """The largest captured batch size."""
        return self.batch_sizes[-1]

    def padded_batch_size(self, batch_size: int) -> int | None:
        """The smallest captured size >= ``batch_size`` (None above the largest)."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def capture(self) -> None:
        """Capture every batch size, largest first so smaller graphs reuse its memory pool (nothing
        to capture when the runner runs batches eagerly)."""
        if not self.replay_captured:
            self._capture_done = True
            return
        tpr = self.tokens_per_request
        memory_pool = self.backend.graph_memory_pool()
        for bs in reversed(self.batch_sizes):
            metadata = build_metadata(
                self.mode,
                kv_lens=[self.fill + tpr - 1] * bs,
                q_lens=[tpr] * bs,
                page_table=torch.zeros((bs, self.max_pages_per_request), dtype=torch.int32),
                out_cache_loc=[0] * (bs * tpr),
                pool=self.attention.pool,
                max_pages=self.max_pages_per_request,
                tree_mask=chain_tree_mask(bs, tpr) if self.trees else None,
            )
            inputs = {name: buf[: bs * tpr] for name, buf in self._static_inputs.items()}
            captured = CapturedForward(self.backend, functools.partial(self.forward, inputs), metadata,
                                       memory_pool=memory_pool, tp_group=self.tp_group)
            self._captured[bs] = _Captured(captured, inputs)
        self._capture_done = True

    def run(self, inputs: Mapping[str, torch.Tensor], metadata: AttentionMetadata) -> Any:
        """Replay the smallest captured size >= the batch (eagerly above the largest); real rows only."""
        if not self._running.acquire(blocking=False):
            raise GraphError(
                "GraphRunner.run: already running on another thread; a runner's static buffers serve one call at a time"
            )
        try:
            return self._run(inputs, metadata)
        finally:
            self._running.release()

    def _check_inputs(self, inputs: Mapping[str, torch.Tensor], rows: int) -> None:
        if not isinstance(inputs, Mapping) or set(inputs) != set(self._static_inputs):
            got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
            raise SpecError(f"GraphRunner inputs {got} differ from the declared {sorted(self._static_inputs)}")
        for name, value in inputs.items():
            static = self._static_inputs[name]
            if not isinstance(value, torch.Tensor):
                raise SpecError(f"GraphRunner input {name!r} must be a torch.Tensor, got {type(value).__name__}")
            expect = (rows, *static.shape[1:])
            if tuple(value.shape) != expect:
                raise GraphError(
                    f"GraphRunner input {name!r} has shape {tuple(value.shape)}; for this batch its static buffer has shape {expect}"
                )
            if value.dtype != static.dtype:
                raise GraphError(f"GraphRunner input {name!r} has dtype {value.dtype}, its static buffer {static.dtype}")
            if value.device != static.device:
                raise GraphError(f"GraphRunner input {name!r} is on {value.device}, its static buffer on {static.device}")

    def _run(self, inputs: Mapping[str, torch.Tensor], metadata: AttentionMetadata) -> Any:
        if not isinstance(metadata, AttentionMetadata):
            raise SpecError(f"GraphRunner.run: metadata must be a hal.AttentionMetadata, got {type(metadata).__name__}")
        if metadata.mode != self.mode:
            raise SpecError(f"GraphRunner for {self.mode.name} got {metadata.mode.name} metadata")
        b, tpr = metadata.batch_size, self.tokens_per_request
        if any(q != tpr for q in metadata.q_lens_cpu):
            raise SpecError(f"GraphRunner: every request must have {tpr} tokens, got q_lens {metadata.q_lens_cpu}")
        if (metadata.tree_mask is not None) != self.trees:
            raise SpecError(
                f"GraphRunner made with trees={self.trees} got a verify batch "
                f"{'with' if metadata.tree_mask is not None else 'without'} a tree_mask"
            )
        self._check_inputs(inputs, b * tpr)
        # A runner that runs batches eagerly refuses exactly what a replaying one refuses, so engine
        # code tested on one backend behaves alike on every other.
        bs = self.padded_batch_size(b)
        too_long = metadata.block_table.shape[1] > self.max_pages_per_request
        if bs is None or too_long:
            if not self.eager_fallback:
                what = (
                    f"batch of {b} is larger than every captured graph {self.batch_sizes}"
                    if bs is None
                    else f"block table of {metadata.block_table.shape[1]} pages exceeds the captured {self.max_pages_per_request}"
                )
                raise BatchTooLargeError(f"GraphRunner: {what} and eager_fallback is off")
            return self.forward(inputs, metadata)
        if not self._capture_done:
            raise GraphError("GraphRunner.run: capture() first")
        if not self.replay_captured:
            return self.forward(inputs, metadata)
        # A replay runs no Python of the forward, so no plan step: its metadata is checked here.
        check_metadata_against(metadata, self.attention.pool)
        entry = self._captured[bs]
        padded = pad_metadata(metadata, bs, fill=self.fill, max_pages=self.max_pages_per_request, q_len=tpr)
        copies = tuple((entry.inputs[name][: b * tpr], value) for name, value in inputs.items())
        return _slice_rows(entry.forward.replay(padded, copies), b * tpr)


def pad_metadata(
    metadata: AttentionMetadata, batch_size: int, *, fill: int, max_pages: int, q_len: int | None = None
) -> AttentionMetadata:
    """Pad a uniform-q-len batch to ``batch_size`` requests and ``max_pages`` block-table columns.

    Padded requests carry the same q_len as the real ones (a chain, in a tree batch), write to
    slot 0 (the padding slot), read page 0 only, and have ``kv_len = fill + q_len - 1`` (so their first token sees ``fill``
    keys, as ``seq_len_fill_value`` means). ``q_len`` is the per-request query length, needed
    when the batch is empty (default 1 then). Runs on the device; reads no device memory.
    """
    b = metadata.batch_size
    if batch_size < b:
        raise SpecError(f"pad_metadata: batch_size={batch_size} is below the real batch of {b}")
    int_at_least(fill, 1, "pad_metadata: fill")  # kv_lens include the new tokens: a padded row sees itself
    if b and q_len is not None and q_len != metadata.q_lens_cpu[0]:
        raise SpecError(f"pad_metadata: q_len={q_len} but the batch has q_len {metadata.q_lens_cpu[0]}")
    if not metadata.mode.has_uniform_query_len():
        raise SpecError(f"pad_metadata: {metadata.mode.name} batches have ragged q_lens and cannot be padded")
    if metadata.block_table.shape[1] > max_pages:
        raise SpecError(
            f"pad_metadata: block table has {metadata.block_table.shape[1]} pages, more than max_pages={max_pages}"
        )
    q_len = metadata.q_lens_cpu[0] if b else (1 if q_len is None else q_len)
    pad = batch_size - b
    pad_kv = fill + q_len - 1
    dev = metadata.kv_lens.device

    kv_lens = torch.cat([metadata.kv_lens, torch.full((pad,), pad_kv, dtype=metadata.kv_lens.dtype, device=dev)])
    q_lens = torch.cat([metadata.q_lens, torch.full((pad,), q_len, dtype=metadata.q_lens.dtype, device=dev)])
    cu = torch.zeros(batch_size + 1, dtype=metadata.cu_q_lens.dtype, device=dev)
    cu[1:] = torch.cumsum(q_lens, 0)
    pad_pos = torch.arange(fill - 1, fill - 1 + q_len, device=dev, dtype=metadata.positions.dtype).repeat(pad)
    return AttentionMetadata(
        mode=metadata.mode,
        page_size=metadata.page_size,
        kv_lens_cpu=metadata.kv_lens_cpu + (pad_kv,) * pad,
        q_lens_cpu=metadata.q_lens_cpu + (q_len,) * pad,
        kv_lens=kv_lens,
        q_lens=q_lens,
        cu_q_lens=cu,
        positions=torch.cat([metadata.positions, pad_pos]),
        out_cache_loc=torch.cat(
            [metadata.out_cache_loc, torch.zeros(pad * q_len, dtype=metadata.out_cache_loc.dtype, device=dev)]
        ),
        block_table=_padded_table(metadata.block_table, batch_size, max_pages),
        swa_block_table=None if metadata.swa_block_table is None else _padded_table(metadata.swa_block_table, batch_size, max_pages),
        out_cache_loc_host=None if metadata.out_cache_loc_host is None else torch.cat(
            [metadata.out_cache_loc_host, torch.zeros(pad * q_len, dtype=metadata.out_cache_loc_host.dtype)]
        ),
        block_table_host=None if metadata.block_table_host is None else _padded_table(
            metadata.block_table_host, batch_size, max_pages
        ),
        tree_mask=None if metadata.tree_mask is None else torch.cat(
            [metadata.tree_mask, chain_tree_mask(pad, q_len, device=dev)]
        ),
        tree_mask_host=None if metadata.tree_mask_host is None else torch.cat(
            [metadata.tree_mask_host, chain_tree_mask(pad, q_len)]
        ),
    )


def _padded_table(table: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """``table`` in the top-left corner of a ``rows x columns`` table of zeros (the padding page)."""
    out = torch.zeros((rows, columns), dtype=table.dtype, device=table.device)
    out[: table.shape[0], : table.shape[1]] = table
    return out
