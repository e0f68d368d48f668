"""Run one oracle worker script in `world` processes over gloo, their process group made
through a file (`arg["init"]`, `file://...`): no port to find free first (one found free,
then bound by rank 0 later, can be taken meanwhile on a busy box)."""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
from typing import Any

from harness.launch import free_port, spawn_ranks
from tests.support.clock import guard_s, no_answer


def launch(script: str, world: int, arg: dict[str, Any], quiet_s: float = 60.0) -> None:
    """Start `world` ranks of `script` (argv[1] = JSON `arg` + "init": the gloo init method,
    + "port": for a library that only takes a port, SGLang's); fail with their output
    unless every rank exits 0. `quiet_s` is about what the launch takes on a quiet box; a
    launch without an answer within `guard_s(quiet_s)` (10x) is a hang (stragglers killed)."""
    timeout = guard_s(quiet_s)
    with tempfile.TemporaryDirectory(prefix="rplan-gloo-") as tmp:
        _launch(script, world, {**arg, "port": free_port(), "init": f"file://{tmp}/store"},
                timeout)


def _launch(script: str, world: int, arg: dict[str, Any], timeout: float) -> None:
    path = os.path.join(os.path.dirname(__file__), script)
    env = {**os.environ, "RDMA_PLAN_SECRET": secrets.token_hex(32),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    done = spawn_ranks(lambda r: [sys.executable, path, json.dumps(arg)], world,
                       env=lambda r: {**env, "RANK": str(r)}, timeout=timeout)
    if any(f.timed_out for f in done):
        raise AssertionError(no_answer(f"{script} {arg}", timeout))
    if any(f.returncode for f in done):
        tails = "\n".join(f"--- rank {f.rank} (exit {f.returncode})\n{f.output[-4000:]}"
                          for f in done if f.returncode)
        raise AssertionError(f"{script} {arg}: ranks failed\n{tails}")
