"""One rank of the placement plans (tests/support/placement_plans.py) as its own process
(spawned by test_plan_switch.py): step 1 with plan A, the placement changes, step 2 with
plan B, switched to in place.

    python switch_worker.py FOLDER RANK HOST:PORT

FOLDER holds a.rplan, b.rplan and tables.npz (placements a and b). Sources hold step k's
weights (seed k) before step k; targets check after each step, bit for bit, that they hold
what the engine's layout for that step's placement holds. Prints `rank R: ok` with the
transport registrations counted after load (0 expected), and exits non-zero otherwise.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import executor
from executor.errors import PlanSwitchError
from schemas.placement import Placement
from tests.support.placement_plans import config, rank_tensors


def main(folder: str, rank: int, rendezvous: str) -> int:
    host, port = rendezvous.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=90))
    t = np.load(os.path.join(folder, "tables.npz"))
    (cfg_a, spec), (cfg_b, _) = config(t["a"]), config(t["b"])
    sources = 2
    source = rank < sources
    tensors = rank_tensors(cfg_a, spec, rank, seed=1)
    if not source:
        tensors = {k: torch.zeros_like(v) for k, v in tensors.items()}
    ptrs = {k: v.data_ptr() for k, v in tensors.items()}
    ex = executor.load(os.path.join(folder, "a.rplan"), rank, tensors, transport="nixl",
                       rendezvous=store, timeout_s=90, no_identity=True)
    registered = []
    register = ex.transport.register
    ex.transport.register = lambda regions: (registered.append(1), register(regions))[1]
    bad = []

    def check(step: int, cfg) -> None:  # noqa: ANN001
        if source:
            return
        want = rank_tensors(cfg, spec, rank, seed=step)
        bad.extend(f"step {step} {k}" for k, v in want.items() if not torch.equal(tensors[k], v))

    executor.run(ex, 1)
    check(1, cfg_a)
    if source:  # the trainer's next weights
        for k, v in rank_tensors(cfg_a, spec, rank, seed=2).items():
            tensors[k].copy_(v)
    else:  # the engine's placement changed (EPLB): plan A is stale for it
        try:
            ex.switch(os.path.join(folder, "a.rplan"), no_identity=True,
                      placement=Placement(t["b"]))
            bad.append("plan A taken for placement B")
        except PlanSwitchError as e:
            print(f"rank {rank} refused: {e}", flush=True)
    ex.switch(os.path.join(folder, "b.rplan"), no_identity=True,
              placement=None if source else Placement(t["b"]))
    executor.run(ex, 2)
    check(2, cfg_b)
    if {k: v.data_ptr() for k, v in tensors.items()} != ptrs:
        bad.append("a tensor moved")
    print(f"rank {rank}: registrations after load {len(registered)}, register_calls "
          f"{ex.register_calls}, switches {ex.switches}, fingerprint {ex.fingerprint[:16]}",
          flush=True)
    store.set(f"exit/{rank}", b"1")
    store.wait([f"exit/{r}" for r in range(4)], timedelta(seconds=90))
    time.sleep(0.2)
    ex.close()
    if bad:
        print(f"rank {rank}: differ: {bad[:5]}", flush=True)
        return 1
    print(f"rank {rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
