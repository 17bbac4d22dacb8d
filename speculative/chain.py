"""Chain-draft bookkeeping (topk = 1): greedy acceptance and input-id rotation, as tensor ops.

Everything here runs on whichever device the tensors live on, without reading them back, so
the worker syncs with the host once per iteration.
"""

from __future__ import annotations

import torch

from hal.errors import SpecError


def greedy_accept(drafts: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """Accept length per request, bonus included (1 .. S + 1).

    ``drafts [B, S]`` are d1..dS; ``target_tokens [B, S + 1]`` is the target's argmax at the verify
    rows ``[bonus, d1..dS]``. Draft ``d_j`` is accepted while every earlier one was and
    ``d_j == target_tokens[:, j - 1]``; the tokens the iteration emits are then
    ``target_tokens[b, :accept_len[b]]`` (verified drafts, then the target's own next token).
    """
    if drafts.dim() != 2 or target_tokens.dim() != 2 or target_tokens.shape != (drafts.shape[0], drafts.shape[1] + 1):
        raise SpecError(
            f"greedy_accept: need drafts [B, S] and target_tokens [B, S + 1], got "
            f"{tuple(drafts.shape)} and {tuple(target_tokens.shape)}"
        )
    matches = (drafts == target_tokens[:, :-1]).to(torch.int64)
    return torch.cumprod(matches, dim=1).sum(dim=1) + 1


def rotate_input_ids(input_ids: torch.Tensor, select_rows: torch.Tensor, new_tokens: torch.Tensor) -> torch.Tensor:
    """Shift every request's rows left by one and write ``new_tokens[b]`` at row ``select_rows[b]``.

    ``input_ids [T]`` is packed request after request. Row ``i`` takes row ``i + 1``'s token, so after
    ``k`` rotations the row at position ``p`` carries token ``p + k + 1``. Rows past a request's
    ``select_rows`` entry hold junk (the next request's first token lands in its last row); the
    caller only reads the selected rows, and the KV written from junk rows lies beyond the committed
    length, where the next iteration overwrites it.
    """
    if input_ids.dim() != 1 or select_rows.shape != new_tokens.shape or select_rows.dim() != 1:
        raise SpecError(
            f"rotate_input_ids: need input_ids [T], select_rows [B], new_tokens [B], got "
            f"{tuple(input_ids.shape)}, {tuple(select_rows.shape)}, {tuple(new_tokens.shape)}"
        )
    rotated = torch.roll(input_ids, -1)
    rotated[select_rows] = new_tokens.to(rotated.dtype)
    return rotated
