"""Whom to blame when a wait times out: the rank whose heartbeat stopped.

A rank that times out waiting for peer P does not know whether P is dead or alive and
itself waiting for a dead rank Q. Naming P then blames a live rank (before this module, 11
of 15 reports did). So a wait that is about to time out reads every rank's lease
(`control.py`) twice, at least `LEASE_S` apart: a rank with no lease sealed in between
(`control.fresh`: a replayed old record is none) is dead or stopped. The culprit is P if P
is one of those, else the first such rank, else P (alive but not answering: slow, or its
network is). Without heartbeats (the `local` transport, one process) the culprit is P. A
rank's lease is read as `control.alive_record`: its lease key or its beat key (named only
in its encrypted record), whichever is newer, so a stray replaying old records over a live
rank's lease key does not make it look dead.
"""

from __future__ import annotations

import time

from .auth import Record
from .cleanup import best_effort
from .control import BEAT_S, LEASE_S, Control, fresh


class Blame:
    def __init__(self, control: Control, world: int, rank: int, live: bool = True) -> None:
        self.control, self.world, self.rank, self.live = control, world, rank, live
        self.deadline = self.snap_at = self.snap_t = 0.0
        self.snap: dict[int, Record | None] | None = None
        self.snap_wall = 0.0

    def start(self, timeout_s: float) -> None:
        """A wait of `timeout_s` starts now."""
        now = time.monotonic()
        self.deadline = now + timeout_s
        self.snap_at = max(now, self.deadline - LEASE_S - 2 * BEAT_S)
        self.snap = None

    def expired(self) -> bool:
        """Whether the wait has timed out (late enough to tell who is dead)."""
        now = time.monotonic()
        if self.live and self.snap is None and now >= self.snap_at:
            self.snap, self.snap_t, self.snap_wall = self._leases(), now, time.time()
        if now < self.deadline:
            return False
        return not (self.live and self.snap is not None and now - self.snap_t < LEASE_S)

    def due(self) -> float:
        """The `time.monotonic()` before which `expired()` is False and does nothing (a
        wait asks it from then on, not at every poll)."""
        if not self.live:
            return self.deadline
        if self.snap is None:
            return min(self.snap_at, self.deadline)
        return max(self.deadline, self.snap_t + LEASE_S)

    def culprit(self, peer: int) -> int:
        if not self.live or self.snap is None:
            return peer
        stale = [r for r, rec in self._leases().items() if rec is not None]
        for _ in range(3):  # a stray overwriting a live lease with a replay is rewritten by
            stale = [r for r in stale  # its holder within a beat: look again before blaming
                     if (rec := self._leases([r])[r]) is not None
                     and not fresh(rec, self.snap_wall)]
            if not stale:
                break
            time.sleep(BEAT_S / 2)
        return peer if peer in stale or not stale else stale[0]

    def _leases(self, ranks: list[int] | None = None) -> dict[int, Record | None]:
        out: dict[int, Record | None] = {}
        for r in range(self.world) if ranks is None else ranks:
            if r == self.rank:
                continue
            # the store may be gone: no evidence
            out[r] = best_effort(f"reading rank {r}'s lease", self.control.alive_record, r)
        return out
