"""Run one oracle worker script in `world` processes over gloo on a free local port."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, world: int, arg: dict[str, Any], timeout: float = 150.0) -> None:
    """Start `world` ranks of `script` (argv[1] = JSON `arg` + port); fail with their output
    unless every rank exits 0 within `timeout` seconds (stragglers are killed)."""
    arg = {**arg, "port": free_port()}
    path = os.path.join(os.path.dirname(__file__), script)
    env = {**os.environ, "RDMA_PLAN_SECRET": secrets.token_hex(32),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, path, json.dumps(arg)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"{script} {arg}: timed out after {timeout} s") from None
    codes = [p.returncode for p in procs]
    if any(codes):
        tails = "\n".join(f"--- rank {r} (exit {c})\n{o[-4000:]}"
                          for r, (c, o) in enumerate(zip(codes, outs)) if c)
        raise AssertionError(f"{script} {arg}: ranks failed\n{tails}")
