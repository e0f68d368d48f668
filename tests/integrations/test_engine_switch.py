"""The engine side of a plan switch (`integrations/engine_switch.py`, through the shared
`EngineCore` both backends hold): 4 processes over NIXL, FSDP2 sources and two engine ranks
in placement A, step 1; the engine rebalances to B; an update of plan A (its placement now
stale: the core's `begin`), a switch to plan A and to plan B with a version not above the
running one are refused in one line, nothing changed; every rank switches to the replanned B
with memory registered once, steps 2 and 3 bit for bit. vLLM's own EPLB maps feeding the
same check: tests/oracles/test_vllm_eplb_oracle.py; the RPCs on live engines:
tests/live/test_llm_offline.py and tests/integrations/test_sglang_update.py."""

from __future__ import annotations

import os

import pytest

from tests.support.nixl_world import exited_0, nixl_world
from tests.support.placement_plans import write_plans

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_switch_worker.py")


def test_engine_ranks_switch_to_the_replanned_plan_and_refuse_stale_ones(tmp_path):
    pytest.importorskip("nixl")
    write_plans(str(tmp_path))
    done = nixl_world(WORKER, str(tmp_path), timeout=300)
    exited_0(done)
    for f in done:
        assert f"rank {f.rank}: ok" in f.output and "register_calls 1, switches 1" in f.output
    for f in done[2:]:
        lines = [x for x in f.output.splitlines() if x.startswith(f"rank {f.rank} refused")]
        assert len(lines) == 6, lines
        placement = [x for x in lines if "PlacementMismatchError" in x]
        assert len(placement) == 3 and all("MoE layer" in x and "logical expert" in x
                                           and "nothing was written" in x for x in placement)
        stale = [x for x in lines if "StalePlanError" in x]
        assert "version 0 of" in stale[0] and "not newer than the running plan's 0" in stale[0]
        assert "not an integer" in stale[1]
        assert "version 1 of" in stale[2] and "running plan's 1" in stale[2]
