"""A plan's ranks as processes over NIXL: one worker script a rank, each given the plan, its
rank and the store's `host:port` (hosted here while they run), the job secret set."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable, Sequence

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
