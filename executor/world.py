"""Every rank of a plan in this process, over the `local` transport, in lockstep.

For tests and the compiler's end-to-end checks. Ranks advance stage by stage together:
all send READY, then all run steps 1-4, then all run steps 5-7. A wait that is not
satisfied at that point can never be (signals only come from earlier steps of the
protocol), so it is reported as a plan deadlock instead of hanging.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from schemas.errors import UserError
from schemas.plan import load_plan

from .core import Executor, RunStats
from .errors import PeerTimeoutError
from .transports.local import Fabric


class PlanDeadlockError(UserError, RuntimeError):
    """A rank waits for a signal that no earlier step of the protocol sends."""


def run_all_local(plan_path: str, tensors_by_rank: dict[int, dict[str, torch.Tensor]],
                  steps: int = 1, transport_options: dict[str, Any] | None = None) -> RunStats:
    """Run `steps` steps of every rank of the plan at `plan_path`; stats of the last step
    (`transport_options`: `local`'s, see `transports/options.py`)."""
    plan = load_plan(plan_path)
    fabric = Fabric()
    exs = [Executor(plan.header, rp, tensors_by_rank.get(rp.rank, {}), "local", fabric,
                    transport_options=transport_options, step_records=False)
           for rp in plan.ranks]  # no process can join a world that lives for this call
    for ex in exs:
        ex.register()
    for ex in exs:
        ex.connect()
    total = sum(ex.bytes_per_step for ex in exs)
    received = sum(ex.received_per_step for ex in exs)
    stages = max((len(ex.stages) for ex in exs), default=0)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            waited = _step(exs, stages)
            seconds = time.perf_counter() - t0
    finally:
        for ex in exs:
            ex.close()
    seconds, waited = (seconds, waited) if steps else (0.0, 0.0)
    return RunStats(-1, steps, total, received, seconds, True, min(waited, seconds))


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
