"""One rank of the engine-side plan switch test (test_engine_switch.py) as its own process:
sources load the placement plans' source part with `executor.load`, targets are engine
ranks bound through the shared `EngineCore` (the vLLM and SGLang backends' core), whose
engine placement is the test's table (A, then B after the rebalance).

    python engine_switch_worker.py FOLDER RANK HOST:PORT

Step 1 with plan A (placement A); the engine moves to placement B; each target's core
refuses to begin an update of plan A (the placement names layer and expert) and, asked to
switch to plan A again (version 2), refuses it the same way,
to plan B with version 0 (refused: stale), with the live tensors and the running plan
unchanged by any; then every rank switches to B (version 1: the sources by
`Executor.switch`, the targets by `EngineCore.switch_plan`), steps 2 and 3 bit for bit;
B again at version 1 is refused (stale). Prints `rank R refused: ...` per refusal, then
`rank R: ok` and exits 0, or names what differs and exits 1.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

import executor  # noqa: E402
from integrations.engine_core import EngineCore  # noqa: E402
from integrations.errors import PlacementMismatchError, StalePlanError  # noqa: E402
from schemas.identity import plan_identity  # noqa: E402
from tests.support.nixl_world import join, leave, verdict  # noqa: E402
from tests.support.placement_plans import rank_tensors, read_plans  # noqa: E402


def main(folder: str, rank: int, rendezvous: str) -> int:
    store = join(rendezvous)
    plans = read_plans(folder)
    cfg_a, cfg_b, spec = plans.cfg_a, plans.cfg_b, plans.spec
    world, source = plans.world, rank < plans.sources
    path_a, path_b = plans.path_a, plans.path_b
    tensors = rank_tensors(cfg_a, spec, rank, seed=1)
    bad: list[str] = []
    if source:
        ex = executor.load(path_a, rank, tensors, transport="nixl", rendezvous=store,
                           timeout_s=90, no_identity=True)
        core = None
    engine = {"placement": plans.a}  # the engine's current placement
    if not source:
        tensors = {k: torch.zeros_like(v) for k, v in tensors.items()}
        core = EngineCore(path_a, "vllm", lambda h: plan_identity(h, rank, path_a),
                          placement=lambda _: engine["placement"],
                          allow_unsigned=True)  # the test's plans are unsigned
        ex = core.load(tensors, transport="nixl", rendezvous=store, timeout_s=90)
    ptrs = {k: v.data_ptr() for k, v in tensors.items()}

    def refit(step: int, cfg) -> None:  # noqa: ANN001
        if source:
            for k, v in rank_tensors(cfg, spec, rank, seed=step).items():
                tensors[k].copy_(v)
        else:  # the engine's update begins: its placement is the running plan's
            core.begin(f"v{step}")
        executor.run(ex, step)
        if not source:
            want = rank_tensors(cfg, spec, rank, seed=step)
            bad.extend(f"step {step} {k}" for k, v in want.items()
                       if not torch.equal(tensors[k], v))

    def refused(path: str | None, version: object, error: type) -> None:
        """A switch to `path` at `version` (None: an update of the running plan) refused
        in one line, nothing changed."""
        assert core is not None
        before = {k: v.clone() for k, v in tensors.items()}
        try:
            if path is None:
                core.begin(f"v{version}")
            else:
                core.check_switch(path, version, "engine rank")
            bad.append(f"{os.path.basename(path or core.path)} version {version} was not "
                       "refused")
        except error as e:
            line = str(e)
            print(f"rank {rank} refused: {type(e).__name__}: {line}", flush=True)
            if "\n" in line:
                bad.append(f"a refusal of more than one line: {line!r}")
        if core.pending_switch is not None or ex.fingerprint != core.header.fingerprint:
            bad.append("a refused switch left a pending switch or another plan running")
        if any(not torch.equal(before[k], v) for k, v in tensors.items()):
            bad.append("a refused switch changed the live tensors")

    refit(1, cfg_a)
    if not source:
        engine["placement"] = plans.b  # the engine rebalanced (EPLB)
        refused(None, 2, PlacementMismatchError)
        refused(path_a, 2, PlacementMismatchError)
        refused(path_b, 0, StalePlanError)
        refused(path_b, "1", StalePlanError)
        core.check_switch(path_b, 1, "engine rank")
    store.set(f"checked/{rank}", b"1")  # every rank checked before any switches
    store.wait([f"checked/{r}" for r in range(world)], timedelta(seconds=90))
    if source:
        ex.switch(path_b, no_identity=True)
    else:
        core.switch_plan(path_b, 1, "engine rank")
        if core.plan_version != 1 or core.placement != plans.b:
            bad.append(f"after the switch: version {core.plan_version}, {core.placement}")
    refit(2, cfg_b)
    refit(3, cfg_b)
    if not source:
        refused(path_b, 1, StalePlanError)
        refused(path_a, 2, PlacementMismatchError)
    if {k: v.data_ptr() for k, v in tensors.items()} != ptrs:
        bad.append("a tensor moved")
    print(f"rank {rank}: register_calls {ex.register_calls}, switches {ex.switches}",
          flush=True)
    leave(store, rank, world)
    ex.close()
    return verdict(rank, bad)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
