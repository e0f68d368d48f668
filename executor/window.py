"""The write window of one rank: posted batches, across stages.

At most `limit` batches are in flight; any batch that has landed frees its place (a slow
batch at the head does not hold the others back). A stage's writes are *closed* once all of its
batches are posted; its DONE goes out (`on_landed(stage)`) when the last of them has
landed, which may be after the next stage's first batches were posted: a rank whose
stage has nothing left to receive does not wait for its slowest write before it starts
the next stage (the executor decides when that is allowed, `core.py`). Where the
transport can send a notification from the device once batches have landed, the DONE is
handed to it when the stage closes (`hand_off(stage, batches in flight)` names the peers it
took); `on_landed(stage, those peers)` sends it to the others. A wait for batches to land
calls `on_idle` once it finds none landed (the executor seals the next step's hand-offs
ahead there, `Signals.ahead`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .errors import PeerLostError, PeerTimeoutError
from .spin import Backoff
from .transports.base import Prepared

Entry = Prepared


class Window:
    def __init__(self, rank: int, transport: Any, limit: int,
                 on_landed: Callable[[int, frozenset[int]], None],
                 hand_off: Callable[[int, list[Entry]], frozenset[int]] | None = None,
                 on_idle: Callable[[], None] | None = None) -> None:
        self.rank, self.transport, self.limit = rank, transport, max(1, limit)
        self.on_landed, self.hand_off, self.on_idle = on_landed, hand_off, on_idle
        self.handed: dict[int, frozenset[int]] = {}  # stage -> peers whose DONE the device sends
        self.inflight: deque[tuple[Entry, int]] = deque()
        self.left: dict[int, int] = {}  # stage -> its batches not yet reaped
        self.closed: set[int] = set()
        self.waited = 0.0
        """Seconds of this step spent waiting for batches to land."""

    def begin(self) -> None:
        """A step starts: its waiting counts from zero."""
        self.waited = 0.0

    def __len__(self) -> int:
        return len(self.inflight)

    def post(self, entry: Entry, stage: int, timeout_s: float) -> None:
        """Post one batch of `stage`, first waiting for a place if the window is full."""
        if len(self.inflight) >= self.limit:
            self._reap(timeout_s)
        self.left[stage] = self.left.get(stage, 0) + 1
        try:
            self.transport.post(entry.handle)
        except Exception as e:  # transports raise their own types
            self.inflight.append((entry, stage))  # may be half-posted: settle it too
            raise PeerLostError(self.rank, entry.peer, f"post the writes of stage {stage}",
                                e) from e
        self.inflight.append((entry, stage))

    def close(self, stage: int) -> None:
        """Every batch of `stage` is posted: its DONE goes out once they have landed."""
        self.closed.add(stage)
        if not self.left.get(stage):
            self._finish(stage)
        elif self.hand_off is not None:
            self.handed[stage] = self.hand_off(stage, [e for e, s in self.inflight if s == stage])

    def reap_landed(self) -> int:
        """Reap every batch that has landed, without waiting; how many."""
        landed = [i for i, (e, s) in enumerate(self.inflight) if self._done(e, s)]
        for i in reversed(landed):
            _, stage = self.inflight[i]
            del self.inflight[i]
            self._count(stage)
        return len(landed)

    def drain(self, timeout_s: float) -> None:
        """Wait until every posted batch has landed (and every closed stage's DONE is out)."""
        while self.inflight:
            self._reap(timeout_s)

    def stages(self) -> set[int]:
        """Stages with batches in flight."""
        return {s for _, s in self.inflight}

    def drain_stage(self, stage: int, timeout_s: float) -> None:
        """Wait until no batch of `stage` is in flight."""
        while any(s == stage for _, s in self.inflight):
            self._reap(timeout_s)

    def drain_ids(self, ids: frozenset[int], timeout_s: float) -> None:
        """Wait until no batch whose `id` is in `ids` is in flight."""
        while ids and any(id(e) in ids for e, _ in self.inflight):
            self._reap(timeout_s)

    def abandon(self) -> list[Entry]:
        """The batches still in flight (after a failure): the caller settles them."""
        entries = [e for e, _ in self.inflight]
        self.inflight.clear()
        self.left.clear()
        self.closed.clear()
        self.handed.clear()
        return entries

    def _done(self, entry: Entry, stage: int) -> bool:
        try:
            return bool(self.transport.done(entry.handle))
        except Exception as e:  # transports raise their own types
            raise PeerLostError(self.rank, entry.peer, f"complete the writes of stage {stage}",
                                e) from e

    def _reap(self, timeout_s: float) -> None:
        """Wait until at least one batch has landed, and reap what has."""
        t0 = time.perf_counter()
        deadline, backoff = time.monotonic() + timeout_s, Backoff()
        reap, clock, perf, spin_until = self.reap_landed, time.monotonic, time.perf_counter, \
            backoff.spin_until
        if not reap():
            if self.on_idle is not None:  # nothing landed yet: idle time
                self.on_idle()
            while not reap():
                if clock() >= deadline:
                    entry, stage = self.inflight[0]  # the oldest: it has waited longest
                    raise PeerTimeoutError(self.rank, entry.peer,
                                           f"complete the writes of stage {stage}", timeout_s)
                if perf() >= spin_until:  # spins, then short naps: some transports progress
                    backoff.pause()  # when polled
        self.waited += time.perf_counter() - t0

    def _count(self, stage: int) -> None:
        self.left[stage] -= 1
        if not self.left[stage] and stage in self.closed:
            self._finish(stage)

    def _finish(self, stage: int) -> None:
        self.left.pop(stage, None)
        self.closed.discard(stage)
        self.on_landed(stage, self.handed.pop(stage, frozenset()))
