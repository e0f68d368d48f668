"""How waits pause (`executor/spin.py`): no sleep while spinning, then naps that are a
bounded share of the time waited (so a wait is noticed at most ~2% late), and the
thread's timer slack cut to 1 us so that a nap lasts what it asks for."""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

from executor import spin


def test_naps_are_a_bounded_share_of_the_wait(monkeypatch):
    clock = [100.0]
    naps: list[float] = []
    monkeypatch.setattr(spin.time, "perf_counter", lambda: clock[0])

    def sleep(s: float) -> None:
        naps.append(s)
        waited.append(clock[0] - 100.0)
        clock[0] += s
    waited: list[float] = []
    monkeypatch.setattr(spin.time, "sleep", sleep)
    b = spin.Backoff()
    clock[0] += spin.SPIN_S / 2
    b.pause()
    assert naps == []  # still spinning
    while clock[0] - 100.0 < 0.05:
        clock[0] += 3e-6  # one poll
        b.pause()
    assert naps and min(naps) >= spin.NAP_MIN_S and max(naps) <= spin.NAP_MAX_S
    for nap, before in zip(naps, waited):  # at most NAP_SHARE of the wait so far (or the min)
        assert before >= spin.SPIN_S
        assert nap <= max(spin.NAP_MIN_S, spin.NAP_SHARE * before) + 1e-12


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_timer_slack_is_cut_for_the_waiting_thread():
    out = {}

    prctl = ctypes.CDLL(None).prctl  # PR_GET_TIMERSLACK (30): this thread's, in ns

    def run() -> None:
        prctl(29, 50_000, 0, 0, 0)  # a thread inherits its creator's slack: the default
        before = prctl(30, 0, 0, 0, 0)
        ok = spin.tight_timer_slack()
        out["r"] = (before, ok, prctl(30, 0, 0, 0, 0))
    t = threading.Thread(target=run)
    t.start()
    t.join()
    before, ok, after = out["r"]
    assert ok and after == 1000 and before != 1000
