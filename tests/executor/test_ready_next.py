"""`Executor.run(ready_next=True)`: a target announces its next step's stage-0 READYs at the
end of a step (local transport, two ranks in one process, each `run` on its own thread).
The announced READY waits in the source's inbox for its step, lets the source run that step
before the target's next `run` starts, and nothing else: a source without one cannot write,
a plan switch drops it, `close` voids it, and a `run` of another step is refused."""

from __future__ import annotations

import threading

import pytest
import torch

from executor import Executor, PeerTimeoutError
from executor.transports.local import Fabric
from schemas.header import PlanHeader
from schemas.plan import DONE, READY
from tests.support.plans import rank_plan, region

HEADER = PlanHeader(fingerprint="ready-next-a", world=2)
HEADER_B = PlanHeader(fingerprint="ready-next-b", world=2)
SECRET = b"s" * 32


def _plans(swap: bool = False):
    """Source 0 "x" [8] u8 -> target 1 "x" [8] u8; READY then DONE. `swap`: plan B, which
    writes the two halves swapped."""
    x = region("x", "uint8", (8,))
    writes = ([(0, 1, 0, 0, 0, 4, 4), (0, 1, 0, 4, 0, 0, 4)] if swap
              else [(0, 1, 0, 0, 0, 0, 8)])
    src = rank_plan(0, "source", [x], writes, signals=[(0, 1, DONE)],
                    waits=[(0, 1, READY)], peer_regions={1: (8,)})
    tgt = rank_plan(1, "target", [x], signals=[(0, 0, READY)], waits=[(0, 0, DONE)])
    return src, tgt


def _world(timeout_s: float = 30.0):
    fabric = Fabric()
    src, tgt = _plans()
    data, x = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    s = Executor(HEADER, src, {"x": data}, transport="local", rendezvous=fabric,
                 timeout_s=timeout_s, secret=SECRET, step_records=False)
    t = Executor(HEADER, tgt, {"x": x}, transport="local", rendezvous=fabric,
                 timeout_s=timeout_s, secret=SECRET, step_records=False)
    for ex in (s, t):
        ex.register()
    for ex in (s, t):
        ex.connect()
    return s, t, data, x


def _both(*calls):
    """Run each call on its own thread; their results (or the errors they raised)."""
    out: list = [None] * len(calls)

    def go(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001 - returned for the test to look at
            out[i] = e
    threads = [threading.Thread(target=go, args=(i, fn)) for i, fn in enumerate(calls)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def _arrived(ex: Executor) -> set:
    """What `ex`'s inbox holds after one poll (nothing consumed)."""
    ex.inbox.add(ex.transport.poll(), ex.signals.step)
    return set(ex.inbox.arrived)


def test_the_announced_ready_waits_for_its_step_and_lets_the_source_run_it_alone():
    s, t, data, x = _world()
    try:
        _both(s.run, lambda: t.run(ready_next=True))
        assert torch.equal(x, data) and t.complete
        assert t.announced == (2, (s.incarnation,)) and t.announcements == 1
        assert s.signals.step == 1 and (2, 0, READY, 1) in _arrived(s)
        assert s.inbox.take([(1, 0, READY, 1)]) == [(1, 0, READY, 1)]  # not step 1's
        data.add_(1)
        s.run()  # step 2 with the target outside `run`: the memory was lent
        assert torch.equal(x, data)
        got = t.run()  # its DONE is in already; READY not sent again
        assert got.step == 2 and got.complete and t.announced is None
        assert t.signals.seq == 2  # READY of step 1, the announced READY of step 2
        data.add_(1)
        s.timeout_s = 0.5
        with pytest.raises(PeerTimeoutError):  # nothing announced: the source cannot write
            s.run(step=3)
        assert not torch.equal(x, data)
    finally:
        s.close()
        t.close()


def test_steps_with_ready_next_are_bit_exact_and_a_source_announces_nothing():
    s, t, data, x = _world()
    try:
        for k in range(1, 6):
            data.copy_(torch.arange(8, dtype=torch.uint8) * k)
            _both(lambda: s.run(ready_next=True), lambda k=k: t.run(ready_next=k < 5))
            assert torch.equal(x, data), k
        assert s.announced is None and s.announcements == 0  # its step starts with a wait
        assert t.announced is None and t.announcements == 4 and t.step == s.step == 5
        assert t.signals.seq == 5  # one READY a step: none sent twice
    finally:
        s.close()
        t.close()


def test_a_run_of_another_step_than_announced_is_refused_and_the_announcement_stands():
    s, t, data, x = _world()
    try:
        _both(lambda: s.run(1), lambda: t.run(1, ready_next=True))
        with pytest.raises(ValueError, match=r"announced step 2's READYs: run step 2"):
            t.run(5)
        assert t.announced == (2, (s.incarnation,)) and t.step == 1
        data.add_(3)
        _both(lambda: s.run(2), lambda: t.run(2))
        assert torch.equal(x, data) and t.signals.seq == 2
    finally:
        s.close()
        t.close()


def test_a_plan_switch_drops_the_announced_ready():
    s, t, data, x = _world()
    src_b, tgt_b = _plans(swap=True)
    try:
        _both(s.run, lambda: t.run(ready_next=True))
        assert (2, 0, READY, 1) in _arrived(s)  # the old plan's READY of step 2, in
        _both(lambda: s.switch_plan(HEADER_B, src_b), lambda: t.switch_plan(HEADER_B, tgt_b))
        assert t.announced is None
        assert s.inbox.take([(2, 0, READY, 1)]) == [(2, 0, READY, 1)]  # dropped
        data.add_(1)
        _both(s.run, t.run)  # plan B's step 2: the target sent its READY again
        assert torch.equal(x[:4], data[4:]) and torch.equal(x[4:], data[:4])
        assert t.signals.seq == 3
    finally:
        s.close()
        t.close()


def test_close_voids_an_announced_ready_a_source_had_not_taken():
    s, t, data, x = _world()
    try:
        _both(s.run, lambda: t.run(ready_next=True))
        before = x.clone()
        t.close()
        data.add_(1)
        with pytest.raises(PeerTimeoutError, match="rank 1"):  # PeerAbortError, at once
            s.run()
        assert torch.equal(x, before)
    finally:
        s.close()


def test_a_restarted_source_never_takes_the_ready_announced_to_its_dead_process():
    fabric = Fabric()
    src, tgt = _plans()
    data, x = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    make = lambda plan, tensors: Executor(  # noqa: E731
        HEADER, plan, tensors, transport="local", rendezvous=fabric, timeout_s=1.0,
        secret=SECRET, step_records=True)
    s, t = make(src, {"x": data}), make(tgt, {"x": x})
    for ex in (s, t):
        ex.register()
    for ex in (s, t):
        ex.connect()
    _both(s.run, lambda: t.run(ready_next=True))
    assert t.announced is not None
    s.control.close()  # rank 0's process dies; a new one loads
    s_new = make(src, {"x": data})
    s_new.register()
    s_new.connect()
    assert s_new.rejoined and (2, 0, READY, 1) not in _arrived(s_new)  # not addressed to it
    t.recovery.refresh_peers()  # the target re-imports rank 0 (as a signal of it makes it)
    try:
        data.add_(1)
        _both(s_new.run, t.run)  # the announcement went to the dead process: sent again
        assert torch.equal(x, data) and s_new.step == t.step == 2
        data.add_(1)
        _both(s_new.run, lambda: t.run(ready_next=True))
        assert torch.equal(x, data) and t.announced == (t.step + 1, (s_new.incarnation,))
    finally:
        s_new.close()
        t.close()
