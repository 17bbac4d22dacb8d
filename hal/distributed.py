"""Tensor parallelism over ``torch.distributed`` with each backend's own collective (hccl, nccl, gloo).

``init_tensor_parallel`` starts the process group a rank belongs to, whether the rank was launched
by ``torchrun`` (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` in
the environment) or by hal spawning local processes (``hal generate --tp N``). It names no device:
the collective is ``Backend.collective_backend``, the rank's device is the backend at index
``LOCAL_RANK``. Collectives time out after ``timeout_s``, so a rank that died makes the others fail
with an error instead of waiting forever.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from hal.errors import DistributedError, SpecError
from hal.spec import int_at_least


@attrs.frozen
class TPGroup:
    """One rank's view of its tensor-parallel group (``size == 1``: no group, every op a no-op)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    group: Any = None  # the torch.distributed process group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` from rank ``src`` on every rank, in place; returns ``x``."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=src, group=self.group)
        return x

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """``(start, length)`` of this rank's equal share of ``total`` items; ``SpecError`` naming
        ``what`` when ``total`` does not divide by the group size."""
        if total % self.size:
            raise SpecError(f"tensor parallelism: {what}={total} does not divide by the TP size {self.size}")
        length = total // self.size
        return self.rank * length, length


SINGLE = TPGroup()


def launch_environment(env: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from a ``torchrun``-style environment, or None outside one."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise DistributedError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers: {exc}") from None
    if not 0 <= rank < size or local < 0:
        raise DistributedError(f"RANK={rank} must lie in 0..WORLD_SIZE-1={size - 1}, LOCAL_RANK={local} must be >= 0")
    return rank, size, local


def init_tensor_parallel(
    collective_backend: str,
    *,
    rank: int,
    world_size: int,
    local_rank: int | None = None,
    init_method: str | None = None,
    timeout_s: float = 60.0,
) -> TPGroup:
    """Join (or, for one rank, skip) the process group of ``world_size`` ranks over ``collective_backend``.

    ``init_method`` defaults to ``env://`` (torchrun's ``MASTER_ADDR`` / ``MASTER_PORT``). Every
    collective of the group raises after ``timeout_s`` seconds without its peers.
    """
    world_size = int_at_least(world_size, 1, "world_size", DistributedError)
    rank = int_at_least(rank, 0, "rank", DistributedError)
    if rank >= world_size:
        raise DistributedError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    local = rank if local_rank is None else local_rank
    if world_size == 1:
        return TPGroup(0, 1, local, None)
    import torch.distributed as dist

    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed")
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise DistributedError(
                f"a process group of {dist.get_world_size()} ranks (this is rank {dist.get_rank()}) is already "
                f"running; asked for rank {rank} of {world_size}"
            )
    else:
        dist.init_process_group(
            backend=collective_backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return TPGroup(rank, world_size, local, dist.group.WORLD)


def shutdown(group: TPGroup) -> None:
    """Leave the process group (a no-op for a single rank)."""
    if group.size > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
