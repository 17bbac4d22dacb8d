"""Tree verify: which draft tokens of a verify block each draft token sees.

A ``TARGET_VERIFY`` batch whose drafts branch (EAGLE with topk > 1, n-gram drafts) is a chain batch
plus one fact per request: its **tree mask** ``[N, N]`` bool over the request's ``N`` verify rows,
row ``i`` True at the rows it sees, itself and its ancestors. Every row sees the whole committed
prefix. hal's rules, checked by ``check_tree_mask`` wherever a tree enters a batch:

- a row sees itself (the diagonal is True);
- a row's ancestors come before it in the block (nothing above the diagonal): the order in which
  engines lay out a draft tree, level after level;
- a row sees exactly its parent's rows and itself, so what it sees is one path from a root.

A row's **depth** is the number of ancestors it sees; its position is ``prefix + depth`` (a chain's
row ``i`` has depth ``i``), and a sliding window counts positions, not rows: a row at position
``p`` sees an ancestor or prefix key at position ``j`` when ``j >= p - W``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hal.errors import SpecError
from hal.spec import strict_ints


def tree_mask_from_parents(parents: Sequence[Sequence[int]]) -> torch.Tensor:
    """The ``[B, N, N]`` bool tree mask of requests whose verify rows have these parents: row ``i``
    of request ``b`` hangs from row ``parents[b][i]`` of the same block (``-1``: a root, which sees
    the prefix and itself). A parent must come before its child."""
    rows = [strict_ints(p, f"tree_mask_from_parents: parents[{b}]") for b, p in enumerate(parents)]
    n = len(rows[0]) if rows else 0
    for b, row in enumerate(rows):
        if len(row) != n:
            raise SpecError(f"tree_mask_from_parents: request {b} has {len(row)} rows, request 0 has {n}: "
                            "every request of a verify batch has the same number of rows")
        for i, parent in enumerate(row):
            if not -1 <= parent < i:
                raise SpecError(
                    f"tree_mask_from_parents: request {b} row {i} has parent {parent}, expected -1 (a root) or a "
                    f"row in 0..{i - 1}: a draft token's ancestors are in its block, before it"
                )
    mask = torch.zeros((len(rows), n, n), dtype=torch.bool)
    for i in range(n):
        for b, row in enumerate(rows):
            if row[i] >= 0:
                mask[b, i] = mask[b, row[i]]
        mask[:, i, i] = True
    return mask


def chain_tree_mask(batch: int, rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The tree mask of ``batch`` chains of ``rows`` rows: each row sees every row before it."""
    return torch.ones((rows, rows), dtype=torch.bool, device=device).tril().expand(batch, rows, rows).clone()


def tree_depths(tree_mask: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` int64: each verify row's depth, the number of ancestors it sees."""
    return tree_mask.sum(-1, dtype=torch.int64) - 1


def check_tree_mask(tree_mask: torch.Tensor, batch: int, rows: int, where: str) -> None:
    """Raise ``SpecError`` naming the first request and row of ``tree_mask`` (a host tensor) that
    breaks the rules above, or a shape or dtype other than ``[batch, rows, rows]`` bool."""
    if not isinstance(tree_mask, torch.Tensor):
        raise SpecError(f"{where}: tree_mask must be a torch.Tensor, got {type(tree_mask).__name__}")
    if tree_mask.dtype != torch.bool:
        raise SpecError(f"{where}: tree_mask must be a bool tensor, got {tree_mask.dtype}")
    if tuple(tree_mask.shape) != (batch, rows, rows):
        raise SpecError(f"{where}: tree_mask has shape {tuple(tree_mask.shape)}, expected ({batch}, {rows}, {rows}): "
                        "one [q_len, q_len] mask per request")
    if not tree_mask.numel():
        return
    eye = torch.eye(rows, dtype=torch.bool)
    blind = ~tree_mask.diagonal(dim1=1, dim2=2)
    if bool(blind.any()):
        b, i = (int(x) for x in blind.nonzero()[0])
        raise SpecError(f"{where}: tree_mask request {b} row {i} does not see itself (every draft token sees itself)")
    later = tree_mask & torch.ones((rows, rows), dtype=torch.bool).triu(1)
    if bool(later.any()):
        b, i, j = (int(x) for x in later.nonzero()[0])
        raise SpecError(
            f"{where}: tree_mask request {b} row {i} sees row {j}, which comes after it: a draft token's ancestors "
            "come before it in the block"
        )
    # A row sees exactly its parent's rows and itself; its parent is the last row before it that it sees.
    index = torch.arange(rows)
    parent = torch.where(tree_mask & ~eye, index, -1).amax(-1)  # [B, N]
    inherited = torch.gather(tree_mask, 1, parent.clamp_min(0)[..., None].expand(-1, -1, rows))
    expected = torch.where((parent >= 0)[..., None], inherited, False) | eye
    wrong = (expected != tree_mask).any(-1)
    if bool(wrong.any()):
        b, i = (int(x) for x in wrong.nonzero()[0])
        p = int(parent[b, i])
        raise SpecError(
            f"{where}: tree_mask request {b} row {i} sees rows {tree_mask[b, i].nonzero().flatten().tolist()}, but its "
            f"parent row {p} sees {tree_mask[b, p].nonzero().flatten().tolist()}: a draft token sees exactly its "
            "ancestors and itself (one path from a root)"
        )


__all__ = ["chain_tree_mask", "check_tree_mask", "tree_depths", "tree_mask_from_parents"]
