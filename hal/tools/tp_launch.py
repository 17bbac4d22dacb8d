"""Runs a function on N local ranks, each its own process, and reports the first rank that fails.

``run_ranks(fn, n, *args)`` spawns N processes with a torchrun-style environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free local port), calls
``fn(*args)`` in each and returns every rank's return value. When a rank raises, or exits without
a result, or the ranks outlive ``timeout_s``, the others are terminated and a ``DistributedError``
names the rank and its error. Under ``torchrun`` a program calls ``fn`` directly instead.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from hal.errors import DistributedError
from hal.spec import int_at_least


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, results: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        value = fn(*args)
    except BaseException as exc:  # reported to the parent, which ends the run
        results.put((rank, False, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None
    results.put((rank, True, value, ""))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float | None = None) -> list[Any]:
    """``fn(*args)`` on ``world_size`` local processes (spawned: ``fn`` and ``args`` must pickle);
    their return values by rank. ``timeout_s`` bounds the whole run (None: only the ranks'
    collective timeouts and their exits end it)."""
    world_size = int_at_least(world_size, 1, "world_size", DistributedError)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, results, fn, args), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    failure: str | None = None
    try:
        while len(values) < world_size and failure is None:
            try:
                rank, ok, value, trace = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    time.sleep(0.5)  # a rank that raised may still be flushing its report
                    if results.empty():
                        failure = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a report"
                elif deadline is not None and time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    failure = f"ranks {missing} did not finish within {timeout_s:g} s"
                continue
            if ok:
                values[rank] = value
            else:
                failure = f"rank {rank} failed: {value}\n{trace}".rstrip()
    finally:
        if failure is not None or len(values) < world_size:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join(timeout=10)
    if failure is not None:
        raise DistributedError(failure)
    return [values[r] for r in range(world_size)]
