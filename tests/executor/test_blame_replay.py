"""Blame under lease replay: a stray without the secret keeps writing a LIVE rank's old
lease records over its lease key (far faster than it beats), while another rank is dead.
The survivor that waited on the live rank names the dead one: a rank's beat also goes to a
key named only inside its encrypted record (`control.alive_record`), which a stray cannot
know, so the live rank's fresh beats are seen (executor/blame.py, control.py)."""

from __future__ import annotations

import threading
import time

from executor import control
from executor.auth import keys_from
from executor.blame import Blame
from executor.control import Control
from tests.support.stores import Dict

KEYS = keys_from("s" * 64)
INFO = {"fingerprint": "fp", "sizes": [8], "desc": {}}


def _replay(store: Dict, key: str, values: list[bytes], stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        store.set(key, values[i % len(values)])
        i += 1
        time.sleep(0.001)


def test_a_replay_over_a_live_ranks_lease_does_not_make_it_the_culprit() -> None:
    store = Dict()
    ranks = {r: Control(store, KEYS, "rplan", r, 100 + r, timeout_s=5) for r in (1, 2)}
    for c in ranks.values():
        assert not c.claim()
        c.publish_rank(INFO)
    captured: dict[int, list[bytes]] = {1: [], 2: []}
    t_end = time.monotonic() + 1.0
    while time.monotonic() < t_end:  # the stray reads both leases while both are alive
        for r in (1, 2):
            v = store.get(f"rplan/lease/{r}")
            if v not in captured[r]:
                captured[r].append(v)
        time.sleep(0.02)
    assert len(captured[1]) >= 3
    ranks[2].stop.set()  # rank 2 dies; rank 1 lives on
    ranks[2].thread.join(2)
    time.sleep(0.5)
    stop = threading.Event()
    strays = [threading.Thread(target=_replay, args=(store, f"rplan/lease/{r}", captured[r],
                                                     stop), daemon=True) for r in (1, 2)]
    for t in strays:
        t.start()
    try:
        watcher = Control(store, KEYS, "rplan", 0, 7, timeout_s=5)
        blame = Blame(watcher, 3, 0)
        blame.start(0.0)
        blame.expired()  # the snapshot
        time.sleep(control.LEASE_S + 0.1)
        assert blame.culprit(1) == 2  # rank 1 (alive, its lease replayed over) is waited on
        assert blame.culprit(2) == 2
    finally:
        stop.set()
        for t in strays:
            t.join(2)
        ranks[1].close()
