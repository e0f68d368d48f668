"""Issue 35: a stray process without the job secret replays a rank's lease records (read
from the store while the rank was alive, written back in a loop after it died). Lease
records carry the time they were sealed under their MAC (`executor/control.py`), so the
replay is no evidence of life: the survivors blame the dead rank, and its replacement
takes the lease while the stray keeps replaying. Before, the replay blocked the restart
(`LeaseHeldError`, "held by a live process") and steered blame to a live rank.
"""

from __future__ import annotations

import os
import signal

import pytest

from harness.world import ROOT, check_recovery
from tests.support.strays import StrayWorld

pytest.importorskip("nixl")

CONFIG = os.path.join(ROOT, "plans", "demo.yaml")


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    from planner.compiler import compile_file

    path = str(tmp_path_factory.mktemp("plans") / "demo.rplan")
    compile_file(CONFIG, path)
    return path


@pytest.mark.extended
@pytest.mark.parametrize("victim", [2, 0], ids=["target", "source"])
def test_replayed_leases_block_no_restart_and_steer_no_blame(plan, victim):
    w = StrayWorld(CONFIG, plan, 4, steps=4, timeout_s=3.0)
    try:
        for r in range(4):
            w.spawn(r)
        for r in range(4):
            w.loaded(r, timeout_s=300)  # (a loaded 2-core box: imports take a while)
        res = w.step(1, [0, 1, 2, 3])
        assert all(r["ok"] for r in res.values()) and res[2]["exact"] and res[3]["exact"], res
        got = w.stray("replay", "--ranks", str(victim), "--capture", "2.0")
        assert got["captured"][str(victim)] >= 3, got  # several distinct, validly sealed
        w.signal(victim, signal.SIGKILL)
        alive = [r for r in range(4) if r != victim]
        res = w.step(2, alive, timeout_s=40)
        assert any(not r["ok"] for r in res.values()), res  # someone waited for the victim
        # every survivor that raised names the victim; the replacement loads and takes the
        # lease while the stray still replays; steps 3 and 4 are bit-exact
        check_recovery(w, victim, 2, res, dead=True)
    finally:
        w.close()
