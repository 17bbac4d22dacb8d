"""SGLang's ForwardBatch as hal metadata, and its RadixAttention layers as hal's ``LayerSpec``.

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

from hal.errors import CacheLocationError, SpecError, UnsupportedConfigError
from hal.metadata import AttentionMetadata, build_metadata
from hal.protocols import KVPool
from hal.spec import ForwardMode, LayerSpec, strict_ints
from hal.tree import chain_tree_mask
from hal.integrations.sglang.kv_pool import mirror_swa_pages
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


def host_ints(values: Any, what: str) -> list[int]:
    if values is None:
        raise SpecError(f"attention backend 'hal': ForwardBatch.{what} is missing")
    return list(strict_ints(values.cpu() if isinstance(values, torch.Tensor) else values, f"attention backend 'hal': ForwardBatch.{what}"))


def request_lengths(forward_batch: Any) -> tuple[list[int], list[int]]:
    """``(q_lens, kv_lens)`` of a batch in hal's convention (see the module docstring)."""
    mode = hal_mode(forward_batch.forward_mode)
    seq_lens = host_ints(
        forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens, "seq_lens"
    )
    b = len(seq_lens)
    if mode is ForwardMode.EXTEND:
        q = host_ints(forward_batch.extend_seq_lens_cpu, "extend_seq_lens_cpu")
        return q, seq_lens
    if mode is ForwardMode.DECODE:
        return [1] * b, seq_lens
    if mode is ForwardMode.TARGET_VERIFY:
        n = tokens_per_request(forward_batch)
        return [n] * b, [s + n for s in seq_lens]
    # DRAFT_EXTEND_V2: seq_lens already count the rows being written (SGLang's eager path also
    # fills extend_seq_lens / extend_prefix_lens; its graph path leaves them out).
    if forward_batch.extend_seq_lens_cpu is not None:
        q = host_ints(forward_batch.extend_seq_lens_cpu, "extend_seq_lens_cpu")
    else:
        q = [tokens_per_request(forward_batch)] * b
    if forward_batch.extend_prefix_lens_cpu is not None:
        prefix = host_ints(forward_batch.extend_prefix_lens_cpu, "extend_prefix_lens_cpu")
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
    requests = host_ints(forward_batch.req_pool_indices, "req_pool_indices")
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
