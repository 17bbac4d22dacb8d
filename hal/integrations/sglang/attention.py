"""SGLang attention backend ``hal``: hal metadata from SGLang's ForwardBatch, hal's kernel for the device.

SGLang addresses the KV cache by token slot: ``req_to_token[req, pos]`` is the slot of a request's
token at ``pos`` and ``out_cache_loc`` the slots the new tokens go to. hal addresses it by page
(slot = page * page_size + offset; page 0 is padding, as SGLang's first page is). A request's hal
page table is therefore every ``page_size``-th slot of its ``req_to_token`` row divided by the page
size, and the rows are checked to be page-contiguous before they are trusted.

Lengths per mode (hal's ``kv_lens`` include the tokens being written):

==================  ============================  ==========================================
SGLang mode         query rows per request        keys per request
==================  ============================  ==========================================
EXTEND              ``extend_seq_lens``            ``seq_lens``
DECODE              1                              ``seq_lens``
TARGET_VERIFY       ``num_tokens_per_req``         ``seq_lens + num_tokens_per_req``
DRAFT_EXTEND_V2     ``extend_seq_lens``, else      ``seq_lens`` (they count the new rows)
                    ``num_tokens_per_req``
==================  ============================  ==========================================

A target-verify batch is a chain when its verify input says ``tree_topk == 1``; otherwise (EAGLE
with ``topk > 1``, NGRAM's irregular trees) its ``custom_mask`` becomes hal's tree mask
(``verify_tree_mask``), checked like every hal tree before anything is written.
"""

from __future__ import annotations

from typing import Any

import torch

import hal
from hal.errors import CacheLocationError, SpecError, UnsupportedConfigError
from hal.graph import GraphUpdate
from hal.graph_runner import refreshed_metadata
from hal.metadata import AttentionMetadata, build_metadata, check_metadata_against
from hal.plan import ForwardPlan
from hal.protocols import AttentionKernel, KVPool
from hal.spec import ForwardMode, LayerSpec, strict_ints
from hal.tree import chain_tree_mask
from hal.integrations.sglang.kv_pool import mirror_swa_pages, store_in_hal_pool
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.model_executor.forward_batch_info import ForwardMode as SGLangMode

# SGLang mode -> hal mode. MIXED (prefill and decode rows in one batch) has no hal counterpart.
_MODES = {
    SGLangMode.EXTEND: ForwardMode.EXTEND,
    SGLangMode.DECODE: ForwardMode.DECODE,
    SGLangMode.TARGET_VERIFY: ForwardMode.TARGET_VERIFY,
    SGLangMode.DRAFT_EXTEND_V2: ForwardMode.DRAFT_EXTEND_V2,
}

def hal_mode(mode: Any) -> ForwardMode:
    """hal's mode for an SGLang ``ForwardMode``; ``UnsupportedConfigError`` for the rest."""
    try:
        return _MODES[mode]
    except KeyError:
        names = ", ".join(m.name for m in _MODES)
        raise UnsupportedConfigError(f"attention backend 'hal': forward mode {mode!r} is not supported; expected one of {names}") from None


def tokens_per_request(forward_batch: Any) -> int:
    """Query rows per request of a speculative batch, from its spec_info."""
    spec = forward_batch.spec_info
    if spec is None:
        raise SpecError(f"attention backend 'hal': a {forward_batch.forward_mode.name} batch carries no spec_info")
    n = getattr(spec, "num_tokens_per_req", 0)
    if not isinstance(n, int) or n <= 0:
        n = getattr(spec, "draft_token_num", 0)
    if not isinstance(n, int) or n <= 0:
        raise SpecError(f"attention backend 'hal': spec_info gives no tokens per request (num_tokens_per_req={n!r})")
    return n


def verify_tree_mask(forward_batch: Any, rows: int, prefix_lens: list[int], *, placeholder: bool = False) -> torch.Tensor | None:
    """hal's ``[B, N, N]`` tree mask of a TARGET_VERIFY batch (host tensor), or None for a chain.

    SGLang says a verify batch is a chain with its verify input's ``tree_topk`` (or, on inputs
    without it, ``topk``) of 1, as its own backends read it (an EAGLE chain still carries an
    all-visible mask). Otherwise the tree is the input's flat bool ``custom_mask`` in one of the
    two layouts SGLang builds, told apart by size: QLEN (an ``[N, N]`` block per request: its CPU
    path, NGRAM's) or FULL (per request ``N`` rows over ``prefix + N`` columns: its GPU kernels').
    A FULL row must see the whole prefix. Bit-packed masks, a mask of another size, and an input
    that does not say its shape are refused by name. ``placeholder``: the batch a graph is captured
    on, whose mask SGLang fills with placeholders (all visible) and every replay replaces: a tree is
    then given a chain's mask of its shape, which is a tree.
    """
    spec = forward_batch.spec_info
    kind = getattr(getattr(spec, "spec_input_type", None), "name", type(spec).__name__)
    topk = getattr(spec, "tree_topk", getattr(spec, "topk", None))
    if topk == 1:
        return None
    where = f"attention backend 'hal': the {kind} target-verify batch"
    if topk is None:
        raise UnsupportedConfigError(f"{where} does not say its tree's branching (no tree_topk or topk)")
    if placeholder:
        return chain_tree_mask(len(prefix_lens), rows)
    mask = getattr(spec, "custom_mask", None)
    if not isinstance(mask, torch.Tensor):
        raise SpecError(f"{where} is a tree (tree_topk={topk}) without a custom_mask tensor, got {mask!r}")
    if mask.dtype != torch.bool:
        raise UnsupportedConfigError(f"{where} carries a {mask.dtype} (bit-packed) tree mask; hal reads bool masks "
                                     "(SGLang's QLEN_ONLY or FULL_MASK layouts)")
    flat = mask.reshape(-1).cpu()
    batch, n = len(prefix_lens), rows
    qlen_size, full_size = batch * n * n, n * sum(prefix_lens) + batch * n * n
    if flat.numel() == qlen_size:
        return flat.view(batch, n, n).clone()
    if flat.numel() < full_size:
        raise SpecError(f"{where} has a custom_mask of {flat.numel()} entries; expected {qlen_size} ([N, N] per request) "
                        f"or at least {full_size} ([N, prefix + N] per request, N={n}, prefixes {prefix_lens})")
    tree = torch.empty((batch, n, n), dtype=torch.bool)
    at = 0
    for b, prefix in enumerate(prefix_lens):
        block = flat[at : at + n * (prefix + n)].view(n, prefix + n)
        hidden = ~block[:, :prefix]
        if bool(hidden.any()):
            row, key = (int(x) for x in hidden.nonzero()[0])
            raise SpecError(f"{where}: request {b} row {row} hides prefix key {key}; a draft token sees the whole "
                            "committed prefix")
        tree[b] = block[:, prefix:]
        at += n * (prefix + n)
    return tree


def _host_ints(values: Any, what: str) -> list[int]:
    if values is None:
        raise SpecError(f"attention backend 'hal': ForwardBatch.{what} is missing")
    return list(strict_ints(values.cpu() if isinstance(values, torch.Tensor) else values, f"attention backend 'hal': ForwardBatch.{what}"))


def request_lengths(forward_batch: Any) -> tuple[list[int], list[int]]:
    """``(q_lens, kv_lens)`` of a batch in hal's convention (see the module docstring)."""
    mode = hal_mode(forward_batch.forward_mode)
    seq_lens = _host_ints(
        forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens, "seq_lens"
    )
    b = len(seq_lens)
    if mode is ForwardMode.EXTEND:
        q = _host_ints(forward_batch.extend_seq_lens_cpu, "extend_seq_lens_cpu")
        return q, seq_lens
    if mode is ForwardMode.DECODE:
        return [1] * b, seq_lens
    if mode is ForwardMode.TARGET_VERIFY:
        n = tokens_per_request(forward_batch)
        return [n] * b, [s + n for s in seq_lens]
    # DRAFT_EXTEND_V2: seq_lens already count the rows being written (SGLang's eager path also
    # fills extend_seq_lens / extend_prefix_lens; its graph path leaves them out).
    if forward_batch.extend_seq_lens_cpu is not None:
        q = _host_ints(forward_batch.extend_seq_lens_cpu, "extend_seq_lens_cpu")
    else:
        q = [tokens_per_request(forward_batch)] * b
    if forward_batch.extend_prefix_lens_cpu is not None:
        prefix = _host_ints(forward_batch.extend_prefix_lens_cpu, "extend_prefix_lens_cpu")
        return q, [p + n for p, n in zip(prefix, q)]
    return q, seq_lens


def page_table_from_req_to_token(rows: torch.Tensor, kv_lens: list[int], page_size: int) -> torch.Tensor:
    """hal's page table ``[B, pages of the longest request]`` from SGLang ``req_to_token`` rows
    (host tensor ``[B, >= max kv_len]``); columns past a request's own pages are 0.

    Raises ``CacheLocationError`` if a row's slots are not whole pages in order (slot of position
    ``p`` = page ``p // page_size`` times the page size plus ``p % page_size``): a page table could
    not describe them and a kernel would read the wrong keys. A row whose every slot is 0 (a padded
    request of a graph batch, or the batch a graph is captured on) reads the padding page.
    """
    width = max(kv_lens, default=0)
    slots = rows[:, :width].long()
    pages = slots[:, ::page_size] // page_size
    used = torch.arange(width) < torch.tensor(kv_lens, dtype=torch.long).unsqueeze(1)  # [B, width]
    if page_size > 1 and width:
        expect = pages.repeat_interleave(page_size, dim=1)[:, :width] * page_size + torch.arange(width) % page_size
        padded = ((slots == 0) | ~used).all(dim=1, keepdim=True)
        wrong = (expect != slots) & used & ~padded
        if bool(wrong.any()):
            i, first = (int(x) for x in wrong.nonzero()[0])
            raise CacheLocationError(
                f"attention backend 'hal': request {i} keeps position {first} at slot {int(slots[i, first])}, "
                f"which is not offset {first % page_size} of the page holding position {first - first % page_size}"
            )
    return pages * used[:, ::page_size]


def metadata_from_forward_batch(
    forward_batch: Any,
    req_to_token: torch.Tensor,
    pool: KVPool,
    *,
    max_pages: int | None = None,
    swa_pool: Any = None,
    window: int | None = None,
    capture: bool = False,
) -> AttentionMetadata:
    """hal ``AttentionMetadata`` for an SGLang ``ForwardBatch`` over ``pool``.

    ``capture``: the batch a graph is captured on (its verify tree is a placeholder, see
    ``verify_tree_mask``).

    ``swa_pool``: the SGLang ``SWAKVPool`` whose storage ``pool`` is; its full-to-SWA mapping is
    mirrored into ``pool`` for this batch's pages first (``window``: the model's sliding window).
    """
    mode = hal_mode(forward_batch.forward_mode)
    q_lens, kv_lens = request_lengths(forward_batch)
    ps = pool.spec.page_size
    width = max(kv_lens, default=0)
    requests = _host_ints(forward_batch.req_pool_indices, "req_pool_indices")
    if len(requests) != len(kv_lens):
        raise SpecError(f"attention backend 'hal': {len(requests)} req_pool_indices for a batch of {len(kv_lens)}")
    bad = [r for r in requests if not 0 <= r < req_to_token.shape[0]]
    if bad:
        raise SpecError(f"attention backend 'hal': req_pool_indices {bad} outside the request table's rows 0..{req_to_token.shape[0] - 1}")
    if width > req_to_token.shape[1]:
        raise SpecError(f"attention backend 'hal': kv length {width} exceeds the request table's {req_to_token.shape[1]} positions")
    rows = req_to_token[torch.tensor(requests, dtype=torch.long, device=req_to_token.device), :width].cpu() if kv_lens else torch.zeros(0, 0)
    page_table = page_table_from_req_to_token(rows, kv_lens, ps)
    tree = None
    if mode is ForwardMode.TARGET_VERIFY:
        tree = verify_tree_mask(forward_batch, q_lens[0] if q_lens else 0, [k - q for k, q in zip(kv_lens, q_lens)],
                                placeholder=capture)
    if swa_pool is not None:
        mirror_swa_pages(swa_pool, pool, rows, page_table, kv_lens, q_lens, window)
    return build_metadata(
        mode,
        kv_lens=kv_lens,
        q_lens=q_lens,
        page_table=page_table,
        out_cache_loc=forward_batch.out_cache_loc,
        pool=pool,
        max_pages=max_pages,
        tree_mask=tree,
    )


def layer_spec(layer: Any, pool_layer: int, *, has_sinks: bool) -> LayerSpec:
    """hal's ``LayerSpec`` for an SGLang ``RadixAttention`` stored at ``pool_layer`` of the pool."""
    if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
        raise UnsupportedConfigError(
            f"attention backend 'hal': layer {layer.layer_id} is {layer.attn_type}; hal runs causal decoder attention only"
        )
    if layer.logit_cap and layer.logit_cap > 0:
        raise UnsupportedConfigError(f"attention backend 'hal': layer {layer.layer_id} has logit_cap={layer.logit_cap}; hal applies none")
    window = layer.sliding_window_size
    return LayerSpec(
        layer_id=pool_layer,
        num_q_heads=layer.tp_q_head_num,
        num_kv_heads=layer.tp_k_head_num,
        head_dim=layer.qk_head_dim,
        v_head_dim=layer.v_head_dim,
        scaling=float(layer.scaling),
        sliding_window=window if window is not None and window >= 0 else None,
        has_sinks=has_sinks,
    )


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


def draft_branch_rows(
    rows: torch.Tensor, seq_lens: list[int], topk: int, num_steps: int, page_size: int, step: int
) -> tuple[torch.Tensor, list[int]]:
    """The ``req_to_token`` rows of a multi-step draft decode's branches at ``step`` (0-based) and
    their KV lengths, request-major (row ``b * topk + j`` is request ``b``'s branch ``j``).

    ``rows`` are the requests' ``req_to_token`` rows (host ``[B, width]``). SGLang's EAGLE worker
    lays each branch's draft tokens after the committed prefix (``prepare_for_draft``): with
    one-token pages branch ``j``'s ``num_steps`` slots follow at ``seq_len + j * num_steps``; with
    larger pages (and ``topk > 1``) each branch owns ``ceil((seq_len % page_size + num_steps) /
    page_size)`` whole pages from the prefix's last full page on, whose first ``seq_len %
    page_size`` slots hold a copy of the prefix's tail. At ``step`` a branch sees the prefix and
    its own ``step + 1`` draft tokens, so its row is the prefix's full pages followed by its pages.
    """
    branches, lens = [], []
    for b, seq_len in enumerate(seq_lens):
        tail = seq_len % page_size if topk > 1 else 0
        base = seq_len - tail
        pages_per_branch = -(-(tail + num_steps) // page_size) if topk > 1 else 0
        for j in range(topk):
            start = base + j * pages_per_branch * page_size
            own = rows[b, start : start + tail + step + 1]
            branches.append(torch.cat([rows[b, :base], own]))
            lens.append(seq_len + step + 1)
    width = max(lens, default=0)
    out = rows.new_zeros((len(branches), width))
    for i, r in enumerate(branches):
        out[i, : r.numel()] = r
    return out, lens


class HalMultiStepDraftBackend:
    """SGLang's multi-step draft decode through hal (EAGLE's draft steps after the first, with
    ``topk`` branches per request): one ``HalAttnBackend`` per step, each given its step's DECODE
    metadata over ``batch * topk`` rows by ``init_forward_metadata`` (the worker runs step ``i``
    with ``attn_backends[i]``). SGLang builds it through hal's platform
    (``create_speculative_draft_decode_backend``, upstream patch ``draft_utils_platform_draft_backends``).
    """

    def __init__(self, model_runner: Any, backend: hal.Backend, topk: int, num_steps: int) -> None:
        self.topk = int(topk)
        self.speculative_num_steps = int(num_steps)
        if self.topk < 1 or self.speculative_num_steps < 2:
            raise SpecError(
                f"attention backend 'hal': multi-step draft decode needs topk >= 1 and at least 2 steps, "
                f"got topk={topk}, speculative_num_steps={num_steps}"
            )
        self.attn_backends = [HalAttnBackend(model_runner, backend) for _ in range(self.speculative_num_steps - 1)]
        first = self.attn_backends[0]
        if first._swa_pool is not None:
            raise UnsupportedConfigError(
                "attention backend 'hal': multi-step draft decode over a hybrid sliding-window draft pool is not served; "
                "a draft model with sliding-window layers drafts through SGLang's multi-layer EAGLE worker"
            )
        self.req_to_token = first.req_to_token
        self.pool = first.pool

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Each step's metadata, from the draft batch (``out_cache_loc``: ``[batch, topk, steps]`` slots)."""
        if forward_batch.forward_mode.is_idle():
            for child in self.attn_backends:
                child.forward_metadata = None
            return
        topk, steps, ps = self.topk, self.speculative_num_steps, self.pool.spec.page_size
        seq_lens = _host_ints(
            forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens, "seq_lens"
        )
        requests = _host_ints(forward_batch.req_pool_indices, "req_pool_indices")
        locs = forward_batch.out_cache_loc
        if locs is None or locs.numel() != len(seq_lens) * topk * steps:
            raise SpecError(
                f"attention backend 'hal': a draft decode batch of {len(seq_lens)} requests, topk {topk} and {steps} steps "
                f"writes {len(seq_lens) * topk * steps} slots, got out_cache_loc of {None if locs is None else locs.numel()}"
            )
        bad = [r for r in requests if not 0 <= r < self.req_to_token.shape[0]]
        if bad:
            raise SpecError(f"attention backend 'hal': req_pool_indices {bad} outside the request table's rows 0..{self.req_to_token.shape[0] - 1}")
        # The furthest req_to_token position a branch reads (draft_branch_rows' layout).
        width = max((s - s % ps + topk * -(-(s % ps + steps) // ps) * ps if topk > 1 else s + steps for s in seq_lens), default=0)
        if width > self.req_to_token.shape[1]:
            raise SpecError(f"attention backend 'hal': draft tokens up to position {width} exceed the request table's {self.req_to_token.shape[1]}")
        rows = self.req_to_token[torch.tensor(requests, dtype=torch.long, device=self.req_to_token.device), :width].cpu()
        per_step = locs.view(len(seq_lens), topk, steps)
        for step, child in enumerate(self.attn_backends):
            branch_rows, kv_lens = draft_branch_rows(rows, seq_lens, topk, steps, ps, step)
            child.forward_metadata = build_metadata(
                ForwardMode.DECODE,
                kv_lens=kv_lens,
                q_lens=[1] * len(kv_lens),
                page_table=page_table_from_req_to_token(branch_rows, kv_lens, ps),
                out_cache_loc=per_step[:, :, step].reshape(-1),
                pool=self.pool,
            )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise UnsupportedConfigError(
            "attention backend 'hal': SGLang's draft decode graphs are not captured through hal's multi-step draft "
            "backend; start the engine with disable_cuda_graph=True"
        )
