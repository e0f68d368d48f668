"""Writes that read their source late, as RDMA and copy engines do: a batch's bytes are
copied only when the transport is polled for it the `LAG`-th time, long after `post`.

Every rank runs in its own thread over an in-process fabric. The plan (fp32 sources
through a small staging budget: 44 stages, packs run early, writes in flight across
stage boundaries) must still land bit-exactly: no early pack may overwrite staging that
a posted write has not read yet. This caught the GPU race of docs/benchmarks-history.md
"4x H200, 14:24 UTC" on CPU (staging in halves: packs of stage s+1 overwrote what stage
s-1's carried writes still had to read); `test_the_check_catches_a_race` shows it still
would."""

from __future__ import annotations

import os
import threading

import torch

from executor.core import Executor
from executor.transports.local import Fabric, LocalTransport
from harness.weights import materialize, random_full_tensors
from planner.compiler import compile_config
from planner.frameworks import build_layout
from planner.validate import load
from schemas.plan_write import write_plan
from schemas.protocol import Overlap
from tests.support.local_refit import world_tensors
from tests.support.threads import lockstep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "configs", "staged-fp32.yaml")
LAG = 4


class LateReads(LocalTransport):
    """`local`, but a posted batch copies its bytes at its `LAG`-th poll (thread-safe)."""

    lock = threading.Lock()

    def post(self, handle) -> None:
        self.left = getattr(self, "left", {})
        self.left[id(handle)] = LAG

    def done(self, handle) -> bool:
        n = self.left.get(id(handle), 0) - 1
        self.left[id(handle)] = n
        if n == 0:
            for op in handle:
                op()
        return n <= 0

    def notify(self, peer: int, msg: bytes) -> None:
        with self.lock:
            super().notify(peer, msg)

    def poll(self) -> list[bytes]:
        with self.lock:
            return super().poll()


def _run(path: str, tensors: dict[int, dict[str, torch.Tensor]], steps: int,
         sources: dict[int, list[dict[str, torch.Tensor]]]) -> None:
    from schemas.plan import load_plan
    plan = load_plan(path)
    fabric = Fabric()
    exs = []
    for rp in plan.ranks:
        ex = Executor(plan.header, rp, tensors[rp.rank], transport="local", rendezvous=fabric,
                      timeout_s=30)
        ex.transport = ex.window.transport = ex.signals.transport = LateReads(
            rp.rank, ex.namespace, fabric)
        exs.append(ex)

    def new_weights(ex: Executor, step: int) -> None:  # the training step: new weights in place
        for name, t in tensors[ex.rank].items() if ex.rank in sources else ():
            t.copy_(sources[ex.rank][step][name])
    lockstep(exs, steps, new_weights)


def _check(tmp_path) -> list[str]:
    cfg, spec = load(CONFIG)
    plan = compile_config(cfg, spec)
    path = str(tmp_path / "p.rplan")
    write_plan(path, plan)
    src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    assert sum(int(Overlap(rp).prepacked.sum()) for rp in plan.ranks) > 20
    steps = 2
    full = [random_full_tensors(spec, seed=7 + k) for k in range(steps)]
    sources = {r: [materialize(src, f, ranks=[r])[r] for f in full] for r in range(src.world)}
    tensors = world_tensors(src, dst, full[0])
    _run(path, tensors, steps, sources)
    want = materialize(dst, full[-1])
    return [f"rank {src.world + r}: {n}" for r, ts in want.items() for n, w in ts.items()
            if not torch.equal(tensors[src.world + r][n], w)]


def test_writes_that_read_late_land_bit_exact(tmp_path):
    assert _check(tmp_path) == []


def test_the_check_catches_a_race(tmp_path, monkeypatch):
    # Staging in two slots, the rule looking one stage back, no blockers: the packs of
    # stage s+1 go where stage s-1's writes, still in flight, read.
    import schemas.protocol
    from planner.passes import staging
    monkeypatch.setattr(staging, "SLOTS", 2)
    monkeypatch.setattr(schemas.protocol, "SLOTS", 2)
    monkeypatch.setattr(Overlap, "blockers", lambda self, s, inflight: [])
    assert _check(tmp_path) != []
