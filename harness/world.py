"""A fault drill: drive `world_worker.py` processes (a rank each, faults on demand) step by
step through a store hosted here.

Every wait is bounded; `close()` kills what is still running (by pid, this harness's own
children only).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

from harness.launch import master_store

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "world_worker.py")


class World:
    def __init__(self, config: str, plan: str, world: int, steps: int, timeout_s: float = 3.0,
                 tls: str | None = None, plans: dict[int, tuple[str, str]] | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.config, self.plan, self.world, self.steps = config, plan, world, steps
        self.timeout_s, self.extra, self.plans = timeout_s, extra, plans or {}
        self.store, self.port = master_store(30)
        self.secret = secrets.token_hex(32)  # the job secret, as a launcher hands it out
        self.env = {**os.environ, "PYTHONPATH": ROOT, "NIXL_LOG_LEVEL": "ERROR",
                    "UCX_LOG_LEVEL": "fatal", "OMP_NUM_THREADS": "1",
                    "RDMA_PLAN_SECRET": self.secret}
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
                raise AssertionError(f"no {key}: no answer in {timeout_s:.0f} s (box load "
                                     f"{os.getloadavg()[0]:.1f})\n{self.tails()}")
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

    def signal(self, rank: int, sig: int, life: str = "a") -> None:
        os.kill(self.procs[(rank, life)].pid, sig)

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
        for p in self.procs.values():  # stopped ones never exit on their own
            if p.poll() is None and _stopped(p.pid):
                p.kill()
        self.store.set("exit", b"1")
        deadline = time.monotonic() + 20
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def check_recovery(w: World, victim: int, k_fail: int, res: dict, dead: bool = True) -> dict:
    """Step k_fail lost `victim` (killed or stopped): every survivor that raised names it and
    no target claims whole weights; a new process replaces it (SIGKILLing a stopped one) and
    steps k_fail+1, k_fail+2 are bit-exact with one step number everywhere."""
    ranks = sorted({r for r, _ in w.procs})
    alive = [r for r in ranks if r != victim]
    for r in alive:
        got = res[r]
        assert got["ok"] or got["peer"] == victim, (r, got)  # whoever raised names the victim
        if not got["ok"]:
            assert f"rank {victim}" in got["msg"], got
        if r >= 2:  # a target never claims whole weights it did not get
            assert got["complete"] == got["ok"], got
    if not dead:
        w.procs[(victim, "a")].kill()
    assert w.wait_dead(victim) == -9
    w.spawn(victim, life="b", start=k_fail + 1)
    w.loaded(victim, "b")
    for k in (k_fail + 1, k_fail + 2):
        res = w.step(k, ranks)
        assert all(r["ok"] and r["complete"] for r in res.values()), (k, res)
        assert all(res[t]["exact"] for t in ranks if t >= 2), res
        assert len({r["exec_step"] for r in res.values()}) == 1, res  # steps agree
    for r in alive:
        assert res[r]["registers"] == 1, res[r]  # survivors never registered again
    return res
