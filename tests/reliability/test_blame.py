"""Blame the right rank: a source or a target killed (SIGKILL) or stopped (SIGSTOP), between
steps or in the middle of one, over NIXL (4 processes of plans/demo.yaml). Every survivor
that raises names the dead or stopped rank (never a live one that waited for it), no target
claims whole weights, and after a new process replaces it the next two steps are bit-exact.

Before leases and heartbeats, the first rank to time out sent ABORT, which voided its
READY at its peers, and they named it: 11 of 15 reports named a live rank. CI runs two
cases (a target stopped between steps, a source stopped mid-step); the other six are
`slow`.
"""

from __future__ import annotations

import os
import signal

import pytest

from harness.world import ROOT, World, check_recovery
from tests.support.clock import within_guard

pytest.importorskip("nixl")

CONFIG = os.path.join(ROOT, "plans", "demo.yaml")
MID = {0: "post1", 2: "done1"}  # where a source / a target stops itself mid-step


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    from planner.compiler import compile_file

    path = str(tmp_path_factory.mktemp("plans") / "demo.rplan")
    compile_file(CONFIG, path)
    return path


CASES = [(v, sig, when) for v in (0, 2) for sig in ("kill", "stop") for when in ("between", "mid")]
FAST = {(2, "stop", "between"), (0, "stop", "mid")}


@pytest.mark.parametrize("victim, sig, when", [
    c if c in FAST else pytest.param(*c, marks=pytest.mark.extended) for c in CASES])
def test_survivors_name_the_lost_rank(plan, victim, sig, when):
    w = World(CONFIG, plan, 4, steps=4, timeout_s=3.0)
    try:
        for r in range(4):
            die = ""
            if r == victim and when == "mid":
                die = f"2:{'stop-' if sig == 'stop' else ''}{MID[victim]}"
            w.spawn(r, die=die)
        for r in range(4):  # all loaded: step 1 starts together (3 s timeouts on a busy box)
            w.loaded(r)
        res = w.step(1, [0, 1, 2, 3])
        assert all(r["ok"] for r in res.values()) and res[2]["exact"] and res[3]["exact"], res
        if when == "between":
            w.signal(victim, signal.SIGKILL if sig == "kill" else signal.SIGSTOP)
        alive = [r for r in range(4) if r != victim]
        res = w.step(2, alive, timeout_s=40)
        if victim == 0 or when == "between":  # someone depended on it (a target stopped
            assert any(not r["ok"] for r in res.values()), res  # after its DONE: nobody)
        for r in alive:
            if not res[r]["ok"]:
                # the timeout, then telling who is dead (under a second quiet): a guard
                within_guard(res[r]["seconds"] - 3.0, 1.0, f"rank {r} telling who is dead")
        check_recovery(w, victim, 2, res, dead=sig == "kill")
    finally:
        w.close()
