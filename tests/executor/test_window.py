"""The executor's write window (`executor/window.py`) over a transport whose batches land
after a set number of polls, in any order: places free out of order, a stage's DONE goes
out exactly when its last batch has landed, and a batch that never lands times out
naming its peer."""

from __future__ import annotations

import pytest

from executor.errors import PeerTimeoutError
from executor.transports.base import Prepared
from executor.window import Window


class Slow:
    """Batch `h` lands once `done(h)` has been asked `polls[h]` times."""

    def __init__(self, polls: dict[str, int]) -> None:
        self.polls, self.posted, self.asked = dict(polls), [], {}

    def post(self, handle: str) -> None:
        self.posted.append(handle)

    def done(self, handle: str) -> bool:
        self.asked[handle] = self.asked.get(handle, 0) + 1
        return self.asked[handle] > self.polls[handle]


def _window(polls: dict[str, int], limit: int) -> tuple[Window, Slow, list]:
    t, events = Slow(polls), []
    w = Window(0, t, limit, lambda s, _: events.append(("DONE", s, list(t.posted),
                                                      dict(t.asked))))
    return w, t, events


def test_a_slow_head_does_not_hold_the_window():
    # limit 2: "a" takes 1000 polls, "b" and "c" land at once. "c" is posted as soon as
    # "b" has landed, without waiting for "a".
    w, t, _ = _window({"a": 1000, "b": 0, "c": 0, "d": 0}, limit=2)
    for h in "abc":
        w.post(Prepared(h, 7, None), 0, timeout_s=5)
    assert t.posted == ["a", "b", "c"] and t.asked["a"] < 1000


def test_done_of_a_stage_waits_for_its_last_batch_even_across_stages():
    # stage 0: a (slow), b; stage 1: c, d. Stage 1 is posted while "a" is in flight;
    # DONE(1) goes out when c and d have landed (DONE says "this stage's writes landed":
    # the target matches each stage's DONE on its own), DONE(0) only once "a" has.
    w, t, events = _window({"a": 50, "b": 0, "c": 0, "d": 0}, limit=4)
    w.post(Prepared("a", 1, None), 0, 5)
    w.post(Prepared("b", 1, None), 0, 5)
    w.close(0)
    assert w.reap_landed() == 1 and events == []  # b landed; a has not
    w.post(Prepared("c", 2, None), 1, 5)
    w.post(Prepared("d", 2, None), 1, 5)
    w.close(1)
    w.drain(timeout_s=5)
    assert [e[:2] for e in events] == [("DONE", 1), ("DONE", 0)]
    assert events[1][2] == ["a", "b", "c", "d"]  # DONE(0) after stage 1 was posted ...
    assert events[1][3]["a"] == 51  # ... and right when "a" landed (its 51st poll)
    assert events[0][3].get("a", 0) <= 50 and len(w) == 0


def test_a_stage_without_writes_is_done_when_closed():
    w, _, events = _window({}, limit=2)
    w.close(3)
    assert events == [("DONE", 3, [], {})]


def test_a_batch_that_never_lands_times_out_naming_its_peer():
    w, _, _ = _window({"a": 10**9}, limit=1)
    w.post(Prepared("a", 5, None), 2, 5)
    with pytest.raises(PeerTimeoutError, match="5") as e:
        w.drain(timeout_s=0.05)
    assert e.value.peer == 5 and "stage 2" in str(e.value)
    assert [x.handle for x in w.abandon()] == ["a"] and len(w) == 0


def test_a_stage_done_is_handed_off_with_the_batches_still_in_flight():
    # a transport that sends DONE from the device (cuda_ipc) gets the stage's batches in
    # flight when the stage closes; the host then sends DONE only to the peers it did not take
    t, events, handed = Slow({"a": 5, "b": 0, "c": 0}), [], []

    def hand_off(stage: int, entries: list[Prepared]) -> frozenset[int]:
        handed.append((stage, [e.handle for e in entries]))
        return frozenset({7})

    w = Window(0, t, 4, lambda s, h: events.append((s, h)), hand_off)
    w.post(Prepared("a", 7, None), 0, 5)
    w.post(Prepared("b", 8, None), 0, 5)
    assert w.reap_landed() == 1  # b landed before the stage closed: not handed
    w.close(0)
    assert handed == [(0, ["a"])] and events == []
    w.drain(timeout_s=5)
    assert events == [(0, frozenset({7}))]  # DONE(0) from the host to peer 8 only
    w.post(Prepared("c", 7, None), 1, 5)
    w.drain(timeout_s=5)
    w.close(1)  # everything landed already: nothing to hand off
    assert handed == [(0, ["a"])] and events[-1] == (1, frozenset())
