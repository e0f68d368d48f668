"""A hostile process against a running job (NIXL, 4 processes of plans/demo.yaml, with a job
secret): each attack is refused, no target reports a complete step with stale or foreign
weights, and the next honest step is bit-exact on both targets.

The ranks publish their plain descriptors for the stray at `leak/<rank>` (`--leak`): the
worst case, an attacker who already holds the memory keys and agent addresses that the
secret otherwise keeps encrypted in the store. One world serves the attacks in order (each
ends with an honest, checked step); `stray.py` is the attacker, it never has the secret
unless a test says so.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from harness.world import ROOT, check_recovery
from tests.support.strays import StrayWorld

pytest.importorskip("nixl")

CONFIG = os.path.join(ROOT, "plans", "demo.yaml")
RANKS = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    from planner.compiler import compile_file

    path = str(tmp_path_factory.mktemp("plans") / "demo.rplan")
    compile_file(CONFIG, path)
    return path


@pytest.fixture(scope="module")
def world(plan):
    w = StrayWorld(CONFIG, plan, 4, steps=30, timeout_s=3.0, extra=("--leak",))
    try:
        _start(w)
        yield w
    finally:
        w.close()


def _start(w: StrayWorld) -> None:
    """Every rank of `w` spawned and loaded, then one honest step."""
    w.k = 0  # type: ignore[attr-defined]  # the last step run
    for r in RANKS:
        w.spawn(r)
    for r in RANKS:
        w.loaded(r)
    _honest(w)


def _honest(w: StrayWorld) -> dict:
    """The next step, honest: every rank completes, both targets bit-exact."""
    w.k += 1
    k = w.k
    res = w.step(k, RANKS)
    assert all(r["ok"] and r["complete"] for r in res.values()), (k, w.tails())
    assert res[2]["exact"] and res[3]["exact"], res
    return res


def test_forged_done_is_refused(world):
    # DONE (and READY, ACK) of every stage of the next steps "from" both sources, sent before
    # and during them: taken, they would end a target's step before the writes landed
    # its agents carry the sources' NIXL agent names: only the MAC stands in the way
    world.stray("forge", "--target", "2,3", "--claim", "0,1", "--step", str(world.k + 1),
                "--spoof")
    for _ in range(3):  # the forgeries arrive once UCX wired the stray up (a step or two)
        res = _honest(world)
        if all(res[t]["refused"] >= 6 for t in (2, 3)):
            break
    world.strays_stop()
    for t in (2, 3):
        assert res[t]["refused"] >= 6 and "forged" in res[t]["last_refused"], res[t]


def test_impersonation_with_the_secret_but_another_agent_is_refused(world):
    # a process holding the job secret (the MAC is right) but not rank 0's NIXL agent
    world.stray("forge", "--target", "2", "--claim", "0", "--step", str(world.k + 1),
                "--secret", world.secret)
    for _ in range(3):
        res = _honest(world)
        if "impersonation" in res[2]["last_refused"]:
            break
    world.strays_stop()
    assert "impersonation" in res[2]["last_refused"], res[2]


def test_hijack_of_a_source_and_a_target_record_is_refused(world):
    # the stray re-publishes itself as source 0 and target 2 (and moves rank 1's record to
    # rank 0's key); the owners rewrite their records, readers refuse the forged ones
    world.stray("records", "--ranks", "0,2")
    res = _honest(world)
    deadline = time.monotonic() + 15.0  # a heartbeat (every 0.25 s) sees the forgery: on an
    while time.monotonic() < deadline:  # idle box five steps take less than one beat
        if res[0]["republished"] >= 1 and res[2]["republished"] >= 1:
            break
        time.sleep(0.1)
        res = _honest(world)
    assert res[0]["republished"] >= 1 and res[2]["republished"] >= 1, res
    _sealed_by(world, "rplan/rank/0", 0)
    _sealed_by(world, "rplan/rank/2", 2)


def test_garbage_records_and_an_oversized_step(world):
    world.stray("garbage")
    _honest(world)
    for r, kind in ((1, "rank"), (3, "step"), (2, "lease")):
        _sealed_by(world, f"rplan/{kind}/{r}", r)


def test_a_second_process_for_a_live_rank_is_refused(world):
    world.spawn(2, life="dup", start=99)
    got = world.loaded(2, "dup")
    assert got["error"] == "LeaseHeldError" and "rank 2 is held by a live process" in got["msg"]
    _honest(world)


def test_recovery_after_garbage_kills_and_restarts(world):
    # garbage first, then target 3 dies between steps: sources and target 2 name it, a new
    # process takes its lease over, and the next steps are bit-exact
    world.stray("garbage")
    world.signal(3, signal.SIGKILL)
    world.k += 1
    res = world.step(world.k, [0, 1, 2], timeout_s=40)
    assert not res[0]["ok"] and res[0]["peer"] == 3, res[0]
    check_recovery(world, 3, world.k, res)


def _sealed_by(w: StrayWorld, key: str, rank: int, within_s: float = 10.0) -> None:
    """The store value at `key` is (again, within `within_s`: the owner's heartbeat
    rewrites it every 0.25 s) a record of rank `rank` under the job's secret."""
    import time

    from executor.auth import keys_from, open_record
    from executor.errors import ForgedRecordError

    deadline = time.monotonic() + within_s
    while True:
        try:
            open_record(keys_from(w.secret), key, w.store.get(key), rank,
                        encrypted=key.split("/")[1] == "rank")
            return
        except ForgedRecordError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.slow
def test_without_a_secret_the_forged_done_succeeds(plan):
    # the control: the same forgery against a job run with insecure=True ends a target's
    # step on the forged DONE, with stale weights (what the secret prevents above)
    w = StrayWorld(CONFIG, plan, 4, steps=6, timeout_s=3.0, extra=("--leak", "--insecure"))
    try:
        _start(w)
        w.stray("forge", "--target", "2,3", "--claim", "0,1", "--step", "2", "--spoof")
        fooled = []
        for k in (2, 3, 4):
            res = w.step(k, RANKS)
            fooled += [t for t in (2, 3) if res[t]["complete"] and not res[t]["exact"]]
        w.strays_stop()
        assert fooled, res
    finally:
        w.close()
