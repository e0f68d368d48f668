"""Signals between ranks, as the executor sends and awaits them: `Signals`, a part the
executor holds.

`send` sends one kind of signal of a stage to peers (MACed, `signals.encode`); `wait` polls
the transport into the inbox until every awaited signal of this step arrived, a peer aborts
the step (`PeerAbortError`) or the wait times out (`PeerTimeoutError`, blaming the rank
`blame.py` finds); `take` is the non-blocking form; `sync` waits for this rank's own queued
copy kernels. A restarted peer's signals make the wait call `on_foreign` at once (the
executor passes `Recovery.refresh_peers`, which re-imports it).

A step's hand-offs are sealed and checked ahead, in the step's idle time: a wait that finds
its signals missing has the inbox seal the messages it awaits (`Inbox.expect`), and a
step's late idle time (a DONE wait, writes in flight: `ahead`) seals this rank's first
signal of the next step and has the inbox expect the next step's first waits (`head`).
On the path between a peer's signal and this rank's answer there is then one comparison
of bytes where a MAC was computed, and no seal: every check still runs (`signals.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from schemas.plan import ACK, DONE, READY, SLOT_ACK

from . import signals
from .errors import PeerAbortError, PeerLostError, PeerTimeoutError
from .spin import Backoff

if TYPE_CHECKING:
    from .auth import Keys
    from .blame import Blame
    from .transports.base import Transport

KIND_NAMES = {READY: "READY", DONE: "DONE (its writes landed)",
               ACK: "ACK (its staging is free)", SLOT_ACK: "SLOT_ACK (its staging slot is free)"}


@dataclass(frozen=True)
class Sender:
    """Who this rank is, as its signals say (fixed for the executor's life)."""

    rank: int
    tag: bytes
    """The plan's fingerprint tag (`signals.fingerprint_tag`)."""
    incarnation: int
    """This process's random id (`recovery.py`)."""
    keys: Keys
    device: torch.device
    """Where this rank's packs and unpacks queue their kernels."""


class Signals:
    """This rank's signals of the current step. It owns the step it signals for (`begin`),
    its message counter (`seq`), the seconds this step spent waiting (`waited`) and whether
    kernels are queued on the current stream (`queued`); it reads the transport, the
    `inbox` and `blame` it is given."""

    def __init__(self, me: Sender, transport: Transport, inbox: signals.Inbox, blame: Blame,
                 on_foreign: Callable[[], None]) -> None:
        self.me, self.transport, self.inbox, self.blame = me, transport, inbox, blame
        self.on_foreign = on_foreign
        self.step = 0
        """The step whose signals are sent and awaited."""
        self.seq = 0
        """Signals sent by this process (each one's sequence number)."""
        self.waited = 0.0
        """Seconds of this step spent waiting (signals, own kernels)."""
        self.queued = True
        """This rank queued kernels or copies on its current stream since its last `sync`."""
        self.sealer = signals.Sealer(me.keys, me.tag)
        self.first_sends: list[tuple[int, int, int]] = []
        """(peer, stage, kind) of a step's first signal sent, if it is known (`head`)."""
        self.first_waits: list[tuple[int, int, int]] = []
        """(stage, kind, peer) of a step's first wait (`head`)."""
        self.sealed: tuple[tuple[int, int, int, int, int, int], bytes] | None = None
        """The next signal sealed ahead: ((peer, stage, kind, step, seq, addressee's
        incarnation), message); `msg` sends it if that is the signal it makes."""
        self.ahead_at: tuple[int, int] = (-1, -1)
        """(step, seq) when `ahead` last ran: it runs again only once either moved."""
        self.sent_ahead = 0
        """Signals sent as sealed ahead (`ahead`); the rest were sealed when sent."""

    def head(self, sends: list[tuple[int, int, int]], waits: list[tuple[int, int, int]]) -> None:
        """What every step starts with (the executor's plan, at connect and at a switch):
        its first signal sent, (peer, stage, kind), or none; its first wait's signals."""
        self.first_sends, self.first_waits = sends[:1], list(waits)
        self.sealed, self.ahead_at = None, (-1, -1)

    def ahead(self) -> None:
        """Idle time late in a step (a DONE wait, writes in flight): seal the next step's
        first signal (`msg` sends it if it is then the next one made) and have the inbox
        expect the next step's first waits. Done once until the step or this rank's
        sequence number moves; a guess that misses costs this idle time only."""
        at = (self.step, self.seq)
        if at == self.ahead_at:
            return
        self.ahead_at = at
        nxt, me = self.step + 1, self.me
        for peer, stage, kind in self.first_sends:
            to, seq = self.inbox.incarnations.get(peer, 0), self.seq + 1
            self.sealed = ((peer, stage, kind, nxt, seq, to), self.sealer.seal(
                me.incarnation, to, nxt, stage, kind, me.rank, seq))
        if self.first_waits:
            self.inbox.expect([signals.expected(nxt, s, kind, peer)
                               for s, kind, peer in self.first_waits])

    def begin(self, step: int) -> None:
        """Step `step` starts: its signals from now on; older ones are dropped."""
        self.step, self.waited = step, 0.0
        self.inbox.drop_before(step)

    def mark_queued(self, queued: bool = True) -> None:
        """This rank queued kernels or copies on its current stream (when `queued`)."""
        self.queued = self.queued or queued

    def take(self, waits: list[tuple[int, int, int]]) -> bool:
        """Whether every signal of `waits` has arrived (they are consumed if so)."""
        if not waits:
            return True
        self.inbox.add(self.transport.poll(), self.step)
        return not self.inbox.take([signals.expected(self.step, s, kind, peer)
                                    for s, kind, peer in waits])

    def take_all(self, waits: list[tuple[int, int, int]]) -> bool:
        """Whether every signal of `waits` has arrived, after one poll (consumed if so);
        False too where a restarted peer signals (`wait` imports it first)."""
        self.inbox.add(self.transport.poll(), self.step)
        if self.inbox.foreign:
            return False
        return not self.inbox.take([signals.expected(self.step, s, kind, peer)
                                    for s, kind, peer in waits])

    def sync(self) -> None:
        """Wait for the packs/unpacks queued on this rank's current CUDA stream (async
        kernels; a peer must not read or overwrite their staging before they finish).
        Only that stream: a transport's copies of earlier writes may still be running.
        Nothing to do when this rank queued nothing there since its last sync (`queued`):
        a target whose weights arrive by a peer's writes alone, a source without packs."""
        device = self.me.device
        if device.type == "cuda" and self.queued:
            t0 = time.perf_counter()
            torch.cuda.current_stream(device).synchronize()
            self.waited += time.perf_counter() - t0
        self.queued = False

    def retag(self, tag: bytes) -> None:
        """The rank switched plans between steps: its signals carry the new plan's tag."""
        self.me = dataclasses.replace(self.me, tag=tag)
        self.sealer = signals.Sealer(self.me.keys, tag)
        self.sealed, self.ahead_at = None, (-1, -1)  # sealed under the old tag

    def msg(self, peer: int, stage: int, kind: int) -> bytes:
        """The next signal of this step to `peer` (`stage`, `kind`), sealed."""
        me = self.me
        self.seq += 1
        to = self.inbox.incarnations.get(peer, 0)
        sealed = self.sealed
        if sealed is not None:
            self.sealed = None
            if sealed[0] == (peer, stage, kind, self.step, self.seq, to):
                self.sent_ahead += 1
                return sealed[1]  # sealed ahead (`ahead`): the same bytes
        return self.sealer.seal(me.incarnation, to, self.step, stage, kind, me.rank, self.seq)

    def send(self, peers: list[int], stage: int, kind: int) -> None:
        """Send `kind` of `stage` to each of `peers` (`PeerLostError` if one cannot be)."""
        for peer in peers:
            try:
                self.transport.notify(peer, self.msg(peer, stage, kind))
            except Exception as e:  # transports raise their own types
                raise PeerLostError(self.me.rank, peer, f"send {KIND_NAMES[kind]} of stage "
                                    f"{stage}", e) from e

    def wait(self, waits: list[tuple[int, int, int]], timeout_s: float) -> None:
        """Until every signal of `waits` (stage, kind, peer) of this step arrived, or
        `timeout_s` passed."""
        if not waits:
            return
        keys = [signals.expected(self.step, s, kind, peer) for s, kind, peer in waits]
        self.blame.start(timeout_s)
        backoff, t0 = Backoff(), time.perf_counter()
        try:
            self._poll_until(keys, backoff, timeout_s, any(k == DONE for _, k, _ in waits))
        finally:
            self.waited += time.perf_counter() - t0

    def _poll_until(self, keys: list[signals.Key], backoff: Backoff, timeout_s: float,
                    late: bool = False) -> None:
        """Poll until `keys` arrived. The loop between two polls is two clock reads and
        compares: `blame` is asked only from its next moment on (`Blame.due`), the
        backoff only once its spin is over, and the inbox only when a message came. The
        first time they are missing, the inbox expects them (`Inbox.expect`) and, in a
        `late` wait (DONEs), the next step's head is sealed ahead (`ahead`)."""
        rank, step, inbox, blame = self.me.rank, self.step, self.inbox, self.blame
        poll, clock, perf = self.transport.poll, time.monotonic, time.perf_counter
        inbox.add(poll(), step)
        missing, polled = keys, True  # signals may also have arrived before this wait
        idle = True
        due, spin_until = blame.due(), backoff.spin_until
        while True:
            if polled:
                if inbox.foreign:  # a restarted peer already signals: import it now
                    self.on_foreign()
                missing = inbox.take(keys)
                if not missing:
                    return
                if inbox.aborted and (aborted := inbox.abort_of(step, missing)) is not None:
                    raise PeerAbortError(rank, aborted[0], aborted[1], step)
                if idle:  # idle time: what comes next is sealed and expected ahead
                    idle = False
                    inbox.expect(missing)
                    if late:
                        self.ahead()
            if clock() >= due:
                if blame.expired():
                    _, stage, kind, peer = missing[0]
                    culprit = blame.culprit(peer)
                    what = f"send {KIND_NAMES[kind]} of stage {stage}, step {step}"
                    if culprit != peer:
                        what = (f"take part in step {step} (rank {peer}, which this rank "
                                f"waits for, is alive and waits itself; rank {culprit}'s "
                                "heartbeat stopped)")
                    raise PeerTimeoutError(rank, culprit, what, timeout_s)
                due = blame.due()
            if perf() >= spin_until:
                backoff.pause()  # spins briefly, then naps a share of the wait (spin.py)
            msgs = poll()
            if polled := bool(msgs):  # nothing new: nothing to match again
                inbox.add(msgs, step)
