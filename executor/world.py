"""Every rank of a plan in this process, over the `local` transport, in lockstep.

A plan's whole world on one machine, with no rendezvous and no job secret to hand out: the
end-to-end check of a compiled plan and the `local` benchmarks. Ranks advance stage by
stage together:
all send READY, then all run steps 1-4, then all run steps 5-7. A wait that is not
satisfied at that point can never be (signals only come from earlier steps of the
protocol), so it is reported as a plan deadlock instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from schemas.plan import load_plan

from .core import Executor
from .errors import PeerTimeoutError, PlanDeadlockError
from .gpu.graphs import Replay, as_graph, recording
from .stats import RunStats
from .transports.local import Fabric


def run_all_local(plan_path: str, tensors_by_rank: dict[int, dict[str, torch.Tensor]],
                  steps: int = 1, transport_options: dict[str, Any] | None = None,
                  before_step: Callable[[int], None] | None = None) -> RunStats:
    """Run `steps` steps of every rank of the plan at `plan_path`; stats of the last step
    (`transport_options`: `local`'s, see `transports/options.py`). `before_step(k)` runs
    before step k (1, 2, ...): e.g. new source weights, queued on the current stream."""
    plan = load_plan(plan_path)
    fabric = Fabric()
    exs = [Executor(plan.header, rp, tensors_by_rank.get(rp.rank, {}), transport="local",
                    rendezvous=fabric,
                    transport_options=transport_options, step_records=False)
           for rp in plan.ranks]  # no process can join a world that lives for this call
    for ex in exs:
        ex.register()
    for ex in exs:
        ex.connect()
    total = sum(ex.bytes_per_step for ex in exs)
    received = sum(ex.received_per_step for ex in exs)
    stages = max((len(ex.stages) for ex in exs), default=0)
    replay = None
    try:
        for k in range(steps):
            if before_step is not None:
                before_step(k + 1)
            t0 = time.perf_counter()
            if replay is not None:
                waited = _replay(replay, exs[0].device)
            elif k == 0 and steps > 1 and _graphed(exs):
                with recording() as order:
                    waited = _step(exs, stages)
                replay = _step_graph(order, exs[0].device)
            else:
                waited = _step(exs, stages)
            seconds = time.perf_counter() - t0
    finally:
        for ex in exs:
            ex.close()
    seconds, waited = (seconds, waited) if steps else (0.0, 0.0)
    return RunStats(-1, steps, total, received, seconds, True, min(waited, seconds),
                    graphed=replay is not None)


def _graphed(exs: list[Executor]) -> bool:
    """Whether every rank's work is captured graphs on one GPU (see `_step_graph`)."""
    if not exs or not exs[0].transport.options.step_graph:
        return False
    devices = {ex.device for ex in exs}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return False
    ops = [op for ex in exs for st in ex.stages
           for op in [*st.packs, *st.unpacks, *(o for b in st.batches for o in b.handle)]]
    return bool(ops) and all(isinstance(op, Replay) for op in ops)


def _step_graph(order: list[Replay], device: torch.device) -> Replay | None:
    """The first step's GPU work, in the order it ran, as one CUDA graph; None if it cannot
    be captured. Every rank queued it on one stream (`one_stream`) in an order the
    protocol allowed, and every step runs the same ops on the same memory: replaying that
    order is a valid step. Later steps launch this one graph and skip the host protocol,
    which no other process can observe or break here (its waits were all met in step 1)."""
    graph = as_graph([op for r in order for op in r.ops], device, "run_all_local's step")
    return graph[0] if len(graph) == 1 and isinstance(graph[0], Replay) else None


def _replay(replay: Replay, device: torch.device) -> float:
    """One step as the step graph; the seconds spent waiting for it."""
    replay()
    t0 = time.perf_counter()
    torch.cuda.current_stream(device).synchronize()
    return time.perf_counter() - t0


def _step(exs: list[Executor], stages: int) -> float:
    """One step of every rank; the seconds they spent waiting (on their own kernels)."""
    for ex in exs:
        ex.begin_step()
    for s in range(stages):
        try:
            for ex in exs:
                ex.ready(s)
            for ex in exs:
                ex.send_half(s, timeout_s=0.0)
            for ex in exs:
                ex.recv_half(s, timeout_s=0.0)
        except PeerTimeoutError as e:
            raise PlanDeadlockError(f"plan deadlock at stage {s}: {e}. Every wait must match a "
                                    "signal sent earlier in the protocol (schemas/plan.py); "
                                    "the plan's signals and waits do not") from None
    return sum(ex.end_step(time.perf_counter()).waited for ex in exs)
