"""Pure-torch stand-ins for the sgl_kernel CPU ops SGLang's speculative path calls (sgl_kernel has
no CPU build on the registry). Test-only, like hal's NPU emulator: each op is written from its
definition, checks its arguments as strictly as the real op's schema and refuses what it cannot
define, and is held to a hand computation in ``tests/integrations/sglang/test_sgl_kernel_standins.py``.
"""

from __future__ import annotations

import ctypes

import torch


class StandInError(ValueError):
    pass


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For every buffer ``i`` (base address ``data_ptrs[i]``, ``strides[i]`` bytes per slot row),
    copy row ``src_loc[j]`` onto row ``tgt_loc[j]`` for every ``j`` (SGLang's KV move after a
    speculative verify). As the real op: all source rows of a buffer are read before any target
    row is written (gather, then scatter in order), so overlapping and repeated slots are defined:
    a row written twice keeps the later write. Tensors contiguous; ``data_ptrs`` uint64,
    ``strides`` int64 with one entry per buffer, the slot tensors int32 or int64 of one dtype."""
    _contiguous("data_ptrs", data_ptrs, (torch.uint64,))
    _contiguous("strides", strides, (torch.int64,))
    _contiguous("tgt_loc", tgt_loc, (torch.int32, torch.int64))
    _contiguous("src_loc", src_loc, (tgt_loc.dtype,))
    if strides.numel() != data_ptrs.numel():
        raise StandInError(f"strides has {strides.numel()} entries for {data_ptrs.numel()} buffers")
    if tgt_loc.numel() != src_loc.numel():
        raise StandInError(f"tgt_loc has {tgt_loc.numel()} slots, src_loc {src_loc.numel()}")
    targets, sources = tgt_loc.reshape(-1).tolist(), src_loc.reshape(-1).tolist()
    if any(x < 0 for x in targets + sources):
        raise StandInError(f"slots must be >= 0, got tgt_loc {targets}, src_loc {sources}")
    if any(int(s) <= 0 for s in strides.tolist()):
        raise StandInError(f"strides must be positive, got {strides.tolist()}")
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        staged = [(ctypes.c_char * stride)() for _ in sources]
        for row, s in zip(staged, sources):
            ctypes.memmove(row, base + s * stride, stride)
        for row, t in zip(staged, targets):
            ctypes.memmove(base + t * stride, row, stride)


def _ints(name: str, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != dim:
        desc = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise StandInError(f"{name} must be a {dim}-D int32/int64 tensor, got {desc}")
    return t


def _batch(name: str, t: torch.Tensor, batch: int) -> list[int]:
    _ints(name, t.reshape(-1) if t.dim() == 2 and t.shape[1] == 1 else t)
    if t.numel() != batch:
        raise StandInError(f"{name} has {t.numel()} entries for a batch of {batch}")
    return [int(x) for x in t.reshape(-1).tolist()]


def _contiguous(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """The op's ``CHECK_INPUT`` (a contiguous CPU tensor) and its dtype check."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise StandInError(f"{name} must be a contiguous CPU tensor, got {t!r}")
    if t.dtype not in dtypes:
        raise StandInError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    return t


def rotate_input_ids_cpu(
    input_ids: torch.Tensor, extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor, topk_index: torch.Tensor,
    select_index: torch.Tensor | None,
) -> None:
    """In place, per request ``b`` (rows ``start .. start + len - 1`` of ``input_ids``): shift the
    rows one to the left and write the new token into the last row, or into row
    ``select_index[b]`` when given (the draft's next input ids after the target's token).

    As the real op (and SGLang's Triton version): every tensor contiguous; the batch is
    ``extend_seq_lens``' length, and request ``b``'s token is element ``b`` of ``topk_index`` read
    flat, whatever its shape (a ``[bs, topk]`` tensor gives row-major element ``b``, not row
    ``b``'s first). ``topk_index`` and ``select_index`` int64; ``input_ids``, the lengths and the
    starts int32 or int64 (SGLang 0.5.23 hands its draft-extend ``input_ids`` over as int32)."""
    _contiguous("input_ids", input_ids, (torch.int32, torch.int64))
    _contiguous("extend_start_loc", extend_start_loc, (torch.int32, torch.int64))
    _contiguous("extend_seq_lens", extend_seq_lens, (torch.int32, torch.int64))
    _contiguous("topk_index", topk_index, (torch.int64,))
    if select_index is not None:
        _contiguous("select_index", select_index, (torch.int64,))
    lens = [int(x) for x in extend_seq_lens.reshape(-1).tolist()]
    bs = len(lens)
    for name, t in (("extend_start_loc", extend_start_loc), ("topk_index", topk_index), ("select_index", select_index)):
        if t is not None and t.numel() < bs:
            raise StandInError(f"{name} has {t.numel()} elements; the op reads one per request of {bs}")
    starts = [int(x) for x in extend_start_loc.reshape(-1)[:bs].tolist()]
    tokens = topk_index.reshape(-1)[:bs].tolist()
    selected = None if select_index is None else [int(x) for x in select_index.reshape(-1)[:bs].tolist()]
    for b, (start, n) in enumerate(zip(starts, lens)):
        if n < 0 or start < 0 or start + n > input_ids.numel():
            raise StandInError(f"request {b}: rows {start}..{start + n - 1} outside input_ids of {input_ids.numel()}")
        if n == 0:
            continue
        input_ids[start : start + n - 1] = input_ids[start + 1 : start + n].clone()
        last = start + n - 1 if selected is None else selected[b]
        if not 0 <= last < input_ids.numel():
            raise StandInError(f"request {b}: select_index {last} outside input_ids of {input_ids.numel()}")
        input_ids[last] = tokens[b]


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor, verified_seq_len: torch.Tensor, positions: torch.Tensor, retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor, batch_size: int, draft_token_num: int,
) -> None:
    """An n-gram verify tree's links from its ``[bs, n, n]`` (QLEN layout, flat) bool mask, as
    SGLang's op defines them: ``mask[b, i, j]`` with ``j < i`` marks ``j`` an ancestor of ``i``;
    ``positions[b, i]`` = ancestors + ``verified_seq_len[b]``; ``retrive_index`` = ``b * n + i``;
    the next token is the first later node that has ``i`` as an ancestor; the next sibling, the
    first later node that has ``i``'s parent (its latest ancestor) as an ancestor and no ancestor
    between that parent and itself. Every tensor contiguous; the mask bool; ``positions`` and the
    three link tensors of ``verified_seq_len``'s dtype (int32 or int64)."""
    _contiguous("tree_mask", tree_mask, (torch.bool,))
    index_dtype = _contiguous("verified_seq_len", verified_seq_len, (torch.int32, torch.int64)).dtype
    for name, t in (("positions", positions), ("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        _contiguous(name, t, (index_dtype,))
    bs, n = int(batch_size), int(draft_token_num)
    if tree_mask.numel() < bs * n * n or verified_seq_len.numel() < bs:
        raise StandInError(f"tree_mask has {tree_mask.numel()} elements and verified_seq_len {verified_seq_len.numel()}, "
                           f"for a batch of {bs} x {n} x {n}")
    for name, t in (("positions", positions), ("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        if t.numel() < bs * n:
            raise StandInError(f"{name} has {t.numel()} elements for a batch of {bs} x {n}")
    mask = tree_mask.reshape(-1)[: bs * n * n].view(bs, n, n).tolist()
    seq = verified_seq_len.reshape(-1).tolist()
    pos, ri, nt, ns = (t.view(-1) for t in (positions, retrive_index, retrive_next_token, retrive_next_sibling))
    for b in range(bs):
        rows = mask[b]
        for i in range(n):
            ancestors = [j for j in range(i) if rows[i][j]]
            parent = ancestors[-1] if ancestors else -1
            pos[b * n + i] = len(ancestors) + seq[b]
            ri[b * n + i] = b * n + i
            nt[b * n + i] = next((k for k in range(i + 1, n) if rows[k][i]), -1)
            sibling = -1
            if parent != -1:
                sibling = next((k for k in range(i + 1, n) if rows[k][parent] and not any(rows[k][parent + 1 : k])), -1)
            ns[b * n + i] = sibling


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int) -> None:
    """``bonus_tokens[b]`` = request ``b``'s last accepted token: ``accept_tokens`` read flat at
    ``accept_stride * b + accept_lens[b] - 1`` (``accept_lens`` count the bonus token)."""
    batch = bonus_tokens.numel()
    lens = _batch("accept_lens", accept_lens, batch)
    flat = accept_tokens.reshape(-1)
    if not isinstance(accept_stride, int) or accept_stride <= 0:
        raise StandInError(f"accept_stride must be a positive int, got {accept_stride!r}")
    for b, n in enumerate(lens):
        if not 1 <= n <= accept_stride:
            raise StandInError(f"request {b}: accept_len {n} outside 1..{accept_stride}")
        bonus_tokens.view(-1)[b] = flat[accept_stride * b + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor) -> None:
    """The slots of the accepted tokens, packed: for each entry ``i`` of ``accept_index`` (flat)
    that is not -1, ``accept_out_cache_loc[number of non -1 entries before i] =
    out_cache_loc[accept_index[i]]``."""
    index = [int(x) for x in accept_index.reshape(-1).tolist()]
    _ints("out_cache_loc", out_cache_loc)
    kept = [i for i in index if i != -1]
    if any(i < -1 or i >= out_cache_loc.numel() for i in index):
        raise StandInError(f"accept_index {index} outside -1..{out_cache_loc.numel() - 1}")
    if len(kept) > accept_out_cache_loc.numel():
        raise StandInError(f"{len(kept)} accepted slots for an output of {accept_out_cache_loc.numel()}")
    accept_out_cache_loc.view(-1)[: len(kept)] = out_cache_loc[torch.tensor(kept, dtype=torch.long)].to(accept_out_cache_loc.dtype)


def _request_spans(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, starts: list[int], ends: list[int], pool_len: int, packed: torch.Tensor
) -> list[tuple[int, int, int, int]]:
    """``(row, start, end, offset)`` per request, each checked: positions ``start .. end - 1`` of
    ``req_to_token`` row ``row``, whose slots sit at ``offset ..`` of the flat ``packed`` tensor
    (requests packed in order)."""
    _ints("req_to_token", req_to_token, dim=2)
    if pool_len != req_to_token.shape[1]:
        raise StandInError(f"pool_len {pool_len} but req_to_token rows hold {req_to_token.shape[1]}")
    rows = [int(x) for x in _ints("req_pool_indices", req_pool_indices).tolist()]
    if not len(rows) == len(starts) == len(ends):
        raise StandInError(f"{len(rows)} req_pool_indices for {len(starts)} requests")
    spans, at = [], 0
    for b, (row, start, end) in enumerate(zip(rows, starts, ends)):
        if not 0 <= row < req_to_token.shape[0] or not 0 <= start <= end <= pool_len:
            raise StandInError(f"request {b}: row {row}, positions {start}..{end - 1} outside req_to_token {tuple(req_to_token.shape)}")
        spans.append((row, start, end, at))
        at += end - start
    if at > packed.numel():
        raise StandInError(f"out_cache_loc holds {packed.numel()} slots, the batch needs {at}")
    return spans


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
    pool_len: int, topk: int, num_cols: int,
) -> None:
    """``out_cache_loc[b * topk * num_cols + i] = req_to_token[req_pool_indices[b], seq_lens[b] + i]``
    for ``i < topk * num_cols``: each request's next slots, already allocated in its row."""
    starts = _batch("seq_lens", seq_lens, req_pool_indices.numel())
    ends = [start + topk * num_cols for start in starts]
    for row, start, end, at in _request_spans(req_pool_indices, req_to_token, starts, ends, pool_len, out_cache_loc):
        out_cache_loc.view(-1)[at : at + end - start] = req_to_token[row, start:end].to(out_cache_loc.dtype)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor, pool_len: int,
) -> None:
    """Record newly allocated slots in the request table: request ``b``'s positions
    ``start_offset[b] .. end_offset[b] - 1`` take the next ``end - start`` entries of
    ``out_cache_loc`` (requests packed in order)."""
    batch = req_pool_indices.numel()
    loc = _ints("out_cache_loc", out_cache_loc)
    spans = _request_spans(req_pool_indices, req_to_token, _batch("start_offset", start_offset, batch), _batch("end_offset", end_offset, batch), pool_len, loc)
    for row, start, end, at in spans:
        req_to_token[row, start:end] = loc[at : at + end - start].to(req_to_token.dtype)


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor, selected_index: torch.Tensor, verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
    positions: torch.Tensor, retrieve_index: torch.Tensor, retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
    topk: int, depth: int, draft_token_num: int, tree_mask_mode: int,
) -> None:
    """EAGLE's verify tree from the draft steps' choices, as SGLang's tree kernel defines it: per
    request, token 0 is the root (the last verified token) and token ``i`` (``1..N-1``) is draft
    choice ``selected_index[b, i - 1]``, whose parent is ``parent_list[b, selected // topk]`` (the
    root when that is 0). Fills ``positions`` (seq_len + depth), the retrieve links (first child,
    next sibling, newest first) and the tree mask rows (each token sees its ancestors and itself):
    mode 0 (FULL_MASK) rows of ``seq_len + N`` after the prefix columns, mode 1 (QLEN_ONLY) rows of
    N. The bit-packed mode 2 is refused (as SGLang's own Triton version refuses it). A token whose
    parent was not selected (a child that tied its parent's score) is refused: SGLang's kernel
    warns, leaves it unlinked and fills its mask row by reading past the request's row, which
    defines no result to stand in for."""
    n = draft_token_num
    if int(tree_mask_mode) not in (0, 1):
        raise StandInError(f"tree_mask_mode {int(tree_mask_mode)} (bit-packed) is not defined here; expected 0 or 1")
    if tree_mask.dtype != torch.bool or tree_mask.dim() != 1:
        raise StandInError(f"tree_mask must be a flat bool tensor, got {tree_mask.dtype} of shape {tuple(tree_mask.shape)}")
    seq_lens = [int(x) for x in _ints("verified_seq_len", verified_seq_len).tolist()]
    bs = len(seq_lens)
    if selected_index.dim() != 2 or selected_index.shape[0] != bs or selected_index.shape[1] < n - 1:
        raise StandInError(f"selected_index has shape {tuple(selected_index.shape)}, expected ({bs}, >= {n - 1})")
    if parent_list.dim() != 2 or parent_list.shape[0] != bs:
        raise StandInError(f"parent_list has shape {tuple(parent_list.shape)}, expected ({bs}, ...)")
    for name, t in (("retrieve_index", retrieve_index), ("retrieve_next_token", retrieve_next_token), ("retrieve_next_sibling", retrieve_next_sibling)):
        if tuple(t.shape) != (bs, n):
            raise StandInError(f"{name} has shape {tuple(t.shape)}, expected ({bs}, {n})")
    need = (sum(seq_lens) * n + n * n * bs) if int(tree_mask_mode) == 0 else n * n * bs
    if tree_mask.numel() < need or positions.numel() < bs * n:
        raise StandInError(f"tree_mask holds {tree_mask.numel()} (needs {need}), positions {positions.numel()} (needs {bs * n})")
    selected = selected_index.tolist()
    parents = parent_list.tolist()

    def position_of(b: int, token: int) -> int | None:
        """The tree token (1..N-1) whose draft choice is ``token``, or None for the root."""
        parent_tb = selected[b][token - 1] // topk
        if parent_tb == 0:
            return None
        wanted = parents[b][parent_tb]
        for pp in range(n - 1):
            if selected[b][pp] == wanted:
                return pp + 1
        raise StandInError(f"request {b}: draft token {token}'s parent {wanted} is not among the selected tokens {selected[b]} (parents {parents[b]})")

    prefix = 0
    for b, seq_len in enumerate(seq_lens):
        retrieve_next_token[b].fill_(-1)
        retrieve_next_sibling[b].fill_(-1)
        for i in range(n - 1, 0, -1):  # newest first, as the kernel links them
            retrieve_index[b, i] = b * n + i
            parent = position_of(b, i)
            parent = 0 if parent is None else parent
            previous = int(retrieve_next_token[b, parent])
            retrieve_next_token[b, parent] = i
            if previous != -1:
                retrieve_next_sibling[b, i] = previous
        retrieve_index[b, 0] = b * n
        for token in range(n):
            ancestors, at, hops = [token], token, 0
            while at > 0 and hops < depth:
                parent = position_of(b, at)
                at = 0 if parent is None else parent
                ancestors.append(at)
                hops += 1
            positions.view(-1)[b * n + token] = seq_len + len(ancestors) - 1
            if int(tree_mask_mode) == 0:
                row = prefix * n + n * n * b + (seq_len + n) * token + seq_len
            else:
                row = n * n * b + n * token
            tree_mask[row : row + n] = False
            for a in ancestors:
                tree_mask[row + a] = True
        prefix += seq_len


def verify_tree_greedy_cpu(
    predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor, candidates: torch.Tensor,
    retrive_index: torch.Tensor, retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor,
) -> None:
    """Greedy acceptance down the verify tree, as SGLang's kernel defines it: from the root, take
    the first child (then its siblings) whose draft token equals the target's prediction at the
    last accepted node; record accepted nodes in ``accept_index[b]`` (root first), their count (not
    counting the root) in ``accept_token_num[b]``, and write the target's token at every accepted
    node into ``predicts`` (flat, indexed by retrieve index)."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    for name, t in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token), ("retrive_next_sibling", retrive_next_sibling)):
        if tuple(t.shape) != (bs, n):
            raise StandInError(f"{name} has shape {tuple(t.shape)}, expected ({bs}, {n})")
    if accept_index.shape[0] != bs or accept_token_num.numel() != bs or predicts.numel() < bs * n or target_predict.numel() < bs * n:
        raise StandInError(
            f"accept_index {tuple(accept_index.shape)}, accept_token_num {tuple(accept_token_num.shape)}, predicts "
            f"{tuple(predicts.shape)}, target_predict {tuple(target_predict.shape)} do not fit a batch of {bs} x {n}"
        )
    target = target_predict.reshape(-1)
    flat_predicts = predicts.view(-1)
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, steps):
            node = int(retrive_next_token[b, node])
            wanted = int(target[last])
            while node != -1 and int(candidates[b, node]) != wanted:
                node = int(retrive_next_sibling[b, node])
            if node == -1:
                break
            flat_predicts[last] = wanted
            accepted += 1
            last = int(retrive_index[b, node])
            accept_index[b, accepted] = last
        accept_token_num.view(-1)[b] = accepted
        flat_predicts[last] = target[last]


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor, pool_len: int,
) -> None:
    """Read slots out of the request table: request ``b``'s positions ``start_offset[b] ..
    end_offset[b] - 1`` go to the next ``end - start`` entries of ``out_cache_loc`` (requests
    packed in order); the inverse of ``assign_req_to_token_pool_cpu``."""
    batch = req_pool_indices.numel()
    spans = _request_spans(req_pool_indices, req_to_token, _batch("start_offset", start_offset, batch), _batch("end_offset", end_offset, batch), pool_len, out_cache_loc)
    for row, start, end, at in spans:
        out_cache_loc.view(-1)[at : at + end - start] = req_to_token[row, start:end].to(out_cache_loc.dtype)
