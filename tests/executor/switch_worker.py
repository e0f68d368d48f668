"""One rank of the placement plans (tests/support/placement_plans.py) as its own process
(spawned by test_plan_switch.py and test_plan_switch_cuda_ipc.py): step 1 with plan A, the
placement changes, steps 2 and 3 with plan B, switched to in place.

    python switch_worker.py FOLDER RANK HOST:PORT [TRANSPORT [DEVICE]]

FOLDER holds a.rplan, b.rplan and tables.npz (placements a and b, and the config's dp and
tp). Sources hold step k's weights (seed k) before step k; targets check after each step,
bit for bit, that they hold what the engine's layout for that step's placement holds.
Prints `rank R: ok` with what the transport was asked after load: registrations, exports of
its regions and peer imports (0, 0 and 0 expected), and exits non-zero otherwise. TRANSPORT
defaults to nixl and DEVICE to cpu (cuda_ipc: the tensors live on DEVICE, e.g. cuda:0).
"""

from __future__ import annotations

import json
import sys

import torch

import executor
from executor.errors import PlanSwitchError
from tests.support.nixl_world import join, leave, verdict
from tests.support.placement_plans import rank_tensors, read_plans


def main(folder: str, rank: int, rendezvous: str, transport: str = "nixl",
         device: str = "cpu") -> int:
    store = join(rendezvous)
    plans = read_plans(folder)
    cfg_a, cfg_b, spec = plans.cfg_a, plans.cfg_b, plans.spec
    source = rank < plans.sources
    tensors = rank_tensors(cfg_a, spec, rank, seed=1)
    if not source:
        tensors = {k: torch.zeros_like(v) for k, v in tensors.items()}
    tensors = {k: v.to(device) for k, v in tensors.items()}
    ptrs = {k: v.data_ptr() for k, v in tensors.items()}
    ex = executor.load(plans.path_a, rank, tensors, transport=transport, rendezvous=store,
                       timeout_s=90, no_identity=True)
    asked = {"register": 0, "export": 0, "import_peer": 0}
    for name in asked:  # what registering again would call on the transport
        _count(ex.transport, name, asked)
    before = ex.transport.stats()
    bad: list[str] = []

    def refit(step: int, cfg) -> None:  # noqa: ANN001
        if source:  # the trainer's weights of this step
            for k, v in rank_tensors(cfg, spec, rank, seed=step).items():
                tensors[k].copy_(v)
        executor.run(ex, step)
        if source:
            return
        want = rank_tensors(cfg, spec, rank, seed=step)
        bad.extend(f"step {step} {k}" for k, v in want.items()
                   if not torch.equal(tensors[k].cpu(), v))

    refit(1, cfg_a)
    if not source:  # the engine's placement changed (EPLB): plan A is stale for it
        try:
            ex.switch(plans.path_a, no_identity=True, placement=plans.b)
            bad.append("plan A taken for placement B")
        except PlanSwitchError as e:
            print(f"rank {rank} refused: {e}", flush=True)
    ex.switch(plans.path_b, no_identity=True, placement=None if source else plans.b)
    refit(2, cfg_b)
    refit(3, cfg_b)
    if {k: v.data_ptr() for k, v in tensors.items()} != ptrs:
        bad.append("a tensor moved")
    print(f"rank {rank}: registrations after load {asked['register']}, exports "
          f"{asked['export']}, peer imports {asked['import_peer']}, register_calls "
          f"{ex.register_calls}, switches {ex.switches}, fingerprint {ex.fingerprint[:16]}",
          flush=True)
    if transport == "cuda_ipc":  # peers' handles opened at connect, none since
        print(f"rank {rank} stats before {json.dumps(before)} after "
              f"{json.dumps(ex.transport.stats())}", flush=True)
    leave(store, rank, plans.world)
    ex.close()
    return verdict(rank, bad)


def _count(transport: object, name: str, asked: dict[str, int]) -> None:
    """Count the calls of `transport.name` in `asked[name]`."""
    f = getattr(transport, name)

    def counted(*a: object) -> object:
        asked[name] += 1
        return f(*a)

    setattr(transport, name, counted)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:]))
