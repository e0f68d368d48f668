"""Processes on this machine: a free TCP port, and ranks started and awaited together.

The one way to start a world of ranks and time it out: used by `scripts/demo.py`, the
benchmarks and the tests that run ranks as separate processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The directory that holds the packages (the repository root in a checkout; on `PYTHONPATH`
of every spawned rank)."""


def master_store(timeout_s: float = 30.0) -> tuple[Any, int]:
    """A torch `TCPStore` hosted here on a port the OS picks while binding it (no window
    in which another process can take a port found free a moment before), and its port."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    return store, int(store.port)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process that binds it
    itself; a store hosted here: `master_store`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Finished:
    """One rank's process, after it exited (or was killed)."""

    rank: int
    returncode: int
    output: str
    """stdout (with stderr when merged); "" when not captured."""
    timed_out: bool


def root_env(**extra: str) -> dict[str, str]:
    """This environment with the repository root first on `PYTHONPATH`, plus `extra`."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": ROOT + (os.pathsep + path if path else ""), **extra}


def spawn_ranks(argv: Callable[[int], Sequence[str]], world: int, *,
                env: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
                timeout: float = 180.0, capture: bool = True,
                merge_stderr: bool = True) -> list[Finished]:
    """Start `world` processes (`argv(rank)`, `env` or `env(rank)`, default `root_env()`),
    wait for all of them at most `timeout` seconds in total, kill every straggler, and
    return each rank's exit status and output in rank order."""
    def env_of(r: int) -> dict[str, str]:
        return env(r) if callable(env) else env if env is not None else root_env()

    out = subprocess.PIPE if capture else None
    err = (subprocess.STDOUT if merge_stderr else None) if capture else None
    procs = [subprocess.Popen(list(argv(r)), env=env_of(r), stdout=out, stderr=err, text=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout
    done: list[Finished] = []
    for r, p in enumerate(procs):
        timed_out = False
        try:
            text = p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                if q.poll() is None:
                    q.kill()
            text = p.communicate()[0]
        done.append(Finished(r, p.returncode, text or "", timed_out))
    return done
