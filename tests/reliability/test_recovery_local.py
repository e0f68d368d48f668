"""The recovery rules in one process (local transport, fast): incarnations on signals,
messages meant for a dead process, re-import of a restarted peer, step resync, ABORT."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from executor import Executor, PeerTimeoutError
from executor import signals as sg
from executor.auth import keys_from
from executor.transports.local import Fabric
from schemas.header import PlanHeader
from tests.support.plans import DONE, READY, rank_plan, region

TAG = sg.fingerprint_tag("fp")
HEADER = PlanHeader(fingerprint="fp", world=2)
KEYS = keys_from(b"k" * 32)
SEQ = itertools.count(1)


def _msg(inc, to, step, stage, kind, sender, keys=KEYS):
    """(transport-level sender, message) as a transport's poll returns it."""
    return ("", sg.encode(keys, TAG, inc, to, step, stage, kind, sender, next(SEQ)))


def test_inbox_counts_only_the_imported_incarnation_addressed_to_this_process():
    box = sg.Inbox(TAG, incarnation=7, keys=KEYS)
    box.set_incarnation(1, 100)
    key = sg.expected(3, 0, DONE, 1)
    box.add([_msg(99, 7, 3, 0, DONE, 1)], step=3)  # a dead process of rank 1
    assert box.take([key]) == [key] and box.foreign
    box.add([_msg(100, 6, 3, 0, DONE, 1)], step=3)  # meant for an earlier process of ours
    assert box.take([key]) == [key]
    box.add([_msg(100, 7, 2, 0, DONE, 1)], step=3)  # an earlier step
    assert box.take([key]) == [key]
    box.add([_msg(100, 7, 3, 0, DONE, 1)], step=3)
    assert box.take([key]) == []


def test_inbox_refuses_forged_replayed_and_impersonating_signals():
    box = sg.Inbox(TAG, incarnation=7, rank=2, keys=KEYS)
    box.set_incarnation(1, 100, "agent-of-rank-1")
    key = sg.expected(3, 0, DONE, 1)
    forged = _msg(100, 7, 3, 0, DONE, 1, keys=keys_from(b"another job's secret!"))
    box.add([("agent-of-rank-1", forged[1])], step=3)
    assert box.take([key]) == [key] and box.refused == 1 and "forged" in box.last_refused
    _, good = _msg(100, 7, 3, 0, DONE, 1)
    box.add([("stray-agent", good)], step=3)  # right MAC, wrong transport-level sender
    assert box.take([key]) == [key] and "impersonation" in box.last_refused
    box.add([("agent-of-rank-1", good)], step=3)  # from its own agent: it counts
    assert box.take([key]) == []
    box.add([("agent-of-rank-1", good)], step=3)  # the same message again: a replay
    assert box.take([key]) == [key] and "replayed" in box.last_refused
    assert box.refused == 3 and not box.foreign


def test_held_messages_of_a_restarted_peer_are_admitted_once_imported():
    box = sg.Inbox(TAG, incarnation=7, keys=KEYS)
    box.set_incarnation(1, 100)
    key = sg.expected(4, 0, READY, 1)
    box.add([_msg(200, 7, 4, 0, READY, 1)], step=4)  # the new process, not imported yet
    assert box.take([key]) == [key]
    box.set_incarnation(1, 200)
    assert box.take([key]) == []


def test_abort_names_the_lost_rank_for_that_step_only():
    box = sg.Inbox(TAG, incarnation=7, keys=KEYS)
    box.set_incarnation(1, 100)
    box.add([_msg(100, 7, 5, 3, sg.ABORT, 1)], step=5)  # rank 1 lost rank 3 in step 5
    missing = [sg.expected(5, 0, DONE, 1)]
    assert box.abort_of(5, missing) == (1, 3)
    box.drop_before(6)
    assert box.abort_of(6, [sg.expected(6, 0, DONE, 1)]) is None


def _plans():
    # source 0 "x" [8] u8 -> target 1 "x" [8] u8, one write; READY then DONE
    x = region("x", "uint8", (8,))
    src = rank_plan(0, "source", [x], [(0, 1, 0, 0, 0, 0, 8)], signals=[(0, 1, DONE)],
                    waits=[(0, 1, READY)], peer_regions={1: (8,)})
    tgt = rank_plan(1, "target", [x], signals=[(0, 0, READY)], waits=[(0, 0, DONE)])
    return src, tgt


def _both(a: Executor, b: Executor):
    out, errs = {}, {}

    def go(ex):
        try:
            out[ex.rank] = ex.run()
        except PeerTimeoutError as e:
            errs[ex.rank] = e
    threads = [threading.Thread(target=go, args=(ex,)) for ex in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return out, errs


def test_restarted_target_is_reimported_and_stale_signals_never_count():
    fabric = Fabric()
    src_t = {"x": torch.arange(8, dtype=torch.uint8)}
    src, tgt = _plans()
    s = Executor(HEADER, src, src_t, transport="local", rendezvous=fabric, timeout_s=2.0)
    t_old = Executor(HEADER, tgt, {"x": torch.zeros(8, dtype=torch.uint8)}, transport="local",
                     rendezvous=fabric,
                     timeout_s=2.0)
    for ex in (s, t_old):
        ex.register()
    for ex in (s, t_old):
        ex.connect()
    out, errs = _both(s, t_old)
    assert not errs and out[1].complete
    # the target "dies" in step 2 after sending READY; the source writes into the dead
    # process's memory and sends DONE there; a new process of rank 1 loads
    t_old.begin_step()
    t_old.ready(0)
    s.run()  # lands in t_old: the source cannot know yet
    src_t["x"].add_(1)
    new_x = torch.zeros(8, dtype=torch.uint8)
    t_new = Executor(HEADER, tgt, {"x": new_x}, transport="local", rendezvous=fabric, timeout_s=2.0)
    t_new.register()
    t_new.connect()
    assert t_new.rejoined and t_new.step == 2  # joins at the source's next step (3)
    old_x = t_old.regions[0].clone()
    # a late duplicate of the dead process's READY of step 2 must not start step 3
    t_old.ready(0)
    out, errs = _both(s, t_new)
    assert not errs, errs
    assert s.recovery.reimports == 1 and s.register_calls == 1 and t_new.complete
    assert out[0].step == out[1].step == 3
    assert torch.equal(new_x, src_t["x"]) and torch.equal(t_old.regions[0], old_x)
    src_t["x"].add_(1)
    out, errs = _both(s, t_new)
    assert not errs and torch.equal(new_x, src_t["x"]) and out[0].step == out[1].step == 4


def test_a_rank_that_failed_a_step_alone_runs_it_again_with_its_peers():
    # the restarted target runs (and fails) a step before the source runs at all: their
    # step numbers differ, and the published steps bring them together again
    fabric = Fabric()
    src_t = {"x": torch.arange(8, dtype=torch.uint8)}
    src, tgt = _plans()
    x = torch.zeros(8, dtype=torch.uint8)
    s = Executor(HEADER, src, src_t, transport="local", rendezvous=fabric, timeout_s=1.0)
    t = Executor(HEADER, tgt, {"x": x}, transport="local", rendezvous=fabric, timeout_s=1.0)
    for ex in (s, t):
        ex.register()
    for ex in (s, t):
        ex.connect()
    with pytest.raises(PeerTimeoutError):
        t.run()
    # the target runs step 1 again (no peer had started it); its ABORT voided the READY of
    # the lonely attempt, so the source cannot finish step 1 before the target rejoins it
    rounds = 0
    while True:
        rounds += 1
        src_t["x"].add_(1)
        out, errs = _both(s, t)
        if not errs or rounds == 3:
            break
        assert not t.complete and set(errs) == {1}
    assert not errs and rounds == 1 and out[0].step == out[1].step == 1
    assert torch.equal(x, src_t["x"])
    src_t["x"].add_(1)
    out, errs = _both(s, t)
    assert not errs and out[0].step == out[1].step and torch.equal(x, src_t["x"])


def test_a_source_restarted_while_its_target_is_inside_a_step_joins_the_next_one():
    # Sources 0 and 1 each write 4 bytes of target 2's "x". In step 2 source 1 dies before
    # sending; source 0 finishes its part and goes on; target 2 is inside step 2, waiting
    # for the dead process. A new process of rank 1 starts now. Step 2 cannot take it in
    # (the target's READY went to the dead process), so it must join at step 3, where
    # source 0 and the recovering target go. Joining at the target's published step 2 (the
    # rule before the fix) left it waiting for READYs that never came while the others
    # ran step 3 (`test_source_killed_mid_update`).
    header = PlanHeader(fingerprint="fp", world=3)
    x4, x8 = region("x", "uint8", (4,)), region("x", "uint8", (8,))
    srcs = [rank_plan(r, "source", [x4], [(0, 2, 0, 0, 0, 4 * r, 4)], signals=[(0, 2, DONE)],
                      waits=[(0, 2, READY)], peer_regions={2: (8,)}) for r in (0, 1)]
    tgt = rank_plan(2, "target", [x8], signals=[(0, 0, READY), (0, 1, READY)],
                    waits=[(0, 0, DONE), (0, 1, DONE)])
    fabric = Fabric()
    data = [torch.arange(4, dtype=torch.uint8) + 4 * r for r in (0, 1)]
    x = torch.zeros(8, dtype=torch.uint8)
    ranks = [Executor(header, srcs[r], {"x": data[r]}, transport="local", rendezvous=fabric,
                      timeout_s=1.5)
             for r in (0, 1)] + [Executor(header, tgt, {"x": x}, transport="local",
                                          rendezvous=fabric,
                                          timeout_s=1.5)]
    for ex in ranks:
        ex.register()
    for ex in ranks:
        ex.connect()
    errs: dict[int, BaseException] = {}

    def run_all(exs: list[Executor]) -> None:
        def go(ex: Executor) -> None:
            try:
                ex.run()
            except PeerTimeoutError as e:
                errs[ex.rank] = e
        threads = [threading.Thread(target=go, args=(ex,)) for ex in exs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)

    run_all(ranks)
    assert not errs and torch.equal(x, torch.cat(data))
    for d in data:
        d.add_(10)
    stuck = threading.Thread(target=run_all, args=([ranks[0], ranks[2]],))
    stuck.start()  # step 2 without source 1 (dead)
    while ranks[0].control.peer_step(2) != (2, True):
        time.sleep(1e-3)
    new = Executor(header, srcs[1], {"x": data[1]}, transport="local", rendezvous=fabric,
                   timeout_s=1.5)
    new.register()
    new.connect()
    assert new.rejoined and new.step == 2  # joins at step 3
    stuck.join(timeout=30)
    assert set(errs) == {2} and errs.pop(2).peer == 1
    run_all([ranks[0], new, ranks[2]])
    assert not errs and ranks[2].complete and ranks[2].step == new.step == ranks[0].step == 3
    assert torch.equal(x, torch.cat(data))
