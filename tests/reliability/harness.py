"""Drive fault_worker.py processes step by step through a store hosted here.

Every wait is bounded; `close()` kills what is still running (by pid, this harness's own
children only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from tests.support.procs import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "fault_worker.py")


class World:
    def __init__(self, config: str, plan: str, world: int, steps: int, timeout_s: float = 3.0,
                 tls: str | None = None, plans: dict[int, tuple[str, str]] | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.config, self.plan, self.world, self.steps = config, plan, world, steps
        self.timeout_s, self.extra, self.plans = timeout_s, extra, plans or {}
        self.port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=30))
        self.env = {**os.environ, "PYTHONPATH": ROOT, "NIXL_LOG_LEVEL": "ERROR",
                    "UCX_LOG_LEVEL": "fatal", "OMP_NUM_THREADS": "1"}
        if tls:
            self.env["UCX_TLS"] = tls
        self.procs: dict[tuple[int, str], subprocess.Popen] = {}
        self.logs: dict[tuple[int, str], str] = {}

    def spawn(self, rank: int, life: str = "a", start: int = 1, die: str = "") -> None:
        config, plan = self.plans.get(rank, (self.config, self.plan))
        cmd = [sys.executable, WORKER, "--config", config, "--plan", plan, "--rank", str(rank),
               "--port", str(self.port), "--steps", str(self.steps), "--start", str(start),
               "--timeout", str(self.timeout_s), "--life", life, *self.extra]
        if die:
            cmd += ["--die", die]
        log = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rplan-{self.port}-{rank}{life}.log")
        self.logs[(rank, life)] = log
        with open(log, "w") as out:
            self.procs[(rank, life)] = subprocess.Popen(cmd, env=self.env, stdout=out,
                                                        stderr=subprocess.STDOUT)

    def get(self, key: str, timeout_s: float, rank: int | None = None) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {key} within {timeout_s} s\n{self.tails()}")
            dead = [k for k, p in self.procs.items() if p.poll() not in (None, 0, 4, -9)]
            if dead:
                raise AssertionError(f"worker(s) {dead} failed\n{self.tails()}")
            time.sleep(0.001)
        return json.loads(self.store.get(key))

    def loaded(self, rank: int, life: str = "a", timeout_s: float = 60) -> dict:
        return self.get(f"loaded/{rank}/{life}", timeout_s)

    def step(self, k: int, ranks: list[int], timeout_s: float = 60) -> dict[int, dict]:
        self.store.set(f"go/{k}", b"1")
        return {r: self.get(f"res/{k}/{r}", timeout_s) for r in ranks}

    def wait_dead(self, rank: int, life: str = "a", timeout_s: float = 30) -> int:
        return self.procs[(rank, life)].wait(timeout=timeout_s)

    def tails(self) -> str:
        out = []
        for (r, life), log in self.logs.items():
            with open(log, errors="replace") as f:
                text = f.read()[-1500:]
            out.append(f"--- rank {r}{life} (exit {self.procs[(r, life)].poll()}):\n{text}")
        return "\n".join(out)

    def close(self) -> None:
        self.store.set("exit", b"1")
        deadline = time.monotonic() + 20
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
