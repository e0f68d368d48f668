"""A plan's ranks as processes over NIXL: one worker script a rank, each given the plan, its
rank and the store's `host:port` (hosted here while they run), the job secret set; and, in
each worker, its client of that store (`join`) and its leaving (`leave`: every rank done
before any closes)."""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import executor
from harness.launch import Finished, master_store, root_env, spawn_ranks


def nixl_world(worker: str, path: str, world: int = 4,
               tail: Callable[[int], Sequence[str]] = lambda r: (), timeout: float = 180.0,
               **env: str) -> list[Finished]:
    """`world` processes of `worker PATH RANK HOST:PORT *tail(rank)` (`env` added to the
    environment); each rank's exit status and output, in rank order."""
    store, port = master_store(30)  # alive while the ranks run
    try:
        return spawn_ranks(
            lambda r: [sys.executable, worker, path, str(r), f"127.0.0.1:{port}", *tail(r)],
            world, env=root_env(NIXL_LOG_LEVEL="WARN", RDMA_PLAN_SECRET=secrets.token_hex(32),
                                **env), timeout=timeout)
    finally:
        del store


def exited_0(done: list[Finished]) -> None:
    """Assert every rank exited 0, showing a failed rank's output."""
    for f in done:
        assert f.returncode == 0, f"rank {f.rank} failed:\n{f.output[-3000:]}"


def join(rendezvous: str, timeout_s: float = 90.0) -> Any:
    """In a worker: its client of the store `nixl_world` hosts at `rendezvous`
    ("host:port"), each wait on it bounded by `timeout_s`."""
    return executor.connect_store(rendezvous, timeout_s)


def leave(store: Any, rank: int, world: int, timeout_s: float = 90.0) -> None:
    """In a worker, before it closes its executor: wait until every rank of `world` is done
    with its peers (each sets `exit/<rank>`), then a moment more (a closed peer is a lost
    one)."""
    store.set(f"exit/{rank}", b"1")
    store.wait([f"exit/{r}" for r in range(world)], timedelta(seconds=timeout_s))
    time.sleep(0.2)


def verdict(rank: int, bad: list[str]) -> int:
    """In a worker, last: `rank R: ok` and 0, or the first differences in `bad` and 1."""
    if bad:
        print(f"rank {rank}: differ: {bad[:5]}", flush=True)
        return 1
    print(f"rank {rank}: ok", flush=True)
    return 0
