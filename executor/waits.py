"""Signals between ranks, as the executor sends and awaits them (a mixin of `Executor`).

`_signal` sends one kind of signal of a stage to peers (MACed, `signals.encode`); `_wait`
polls the transport into the inbox until every awaited signal of this step arrived, a peer
aborts the step (`PeerAbortError`) or the wait times out (`PeerTimeoutError`, blaming the
rank `blame.py` finds); `_take` is the non-blocking form; `_sync` waits for this rank's own
queued copy kernels. A restarted peer's signals make the wait re-import it at once
(`Recovery.refresh_peers`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from schemas.plan import ACK, DONE, READY, SLOT_ACK

from . import signals
from .errors import PeerAbortError, PeerLostError, PeerTimeoutError
from .spin import Backoff

if TYPE_CHECKING:
    from .auth import Keys
    from .blame import Blame
    from .recovery import Recovery
    from .transports.base import Transport

_KIND_NAMES = {READY: "READY", DONE: "DONE (its writes landed)",
               ACK: "ACK (its staging is free)", SLOT_ACK: "SLOT_ACK (its staging slot is free)"}


class Signalling:
    """The signal half of `Executor` (its attributes are set by `Executor.__init__`)."""

    rank: int
    step: int
    seq: int
    incarnation: int
    timeout_s: float
    tag: bytes
    keys: Keys
    inbox: signals.Inbox
    transport: Transport
    blame: Blame
    recovery: Recovery
    device: torch.device
    waited: float
    """Seconds of this step spent waiting (signals, landed writes, own kernels)."""
    queued: bool
    """This rank queued kernels or copies on its current stream since its last `_sync`."""

    def _take(self, waits: list[tuple[int, int, int]]) -> bool:
        """Whether every signal of `waits` has arrived (they are consumed if so)."""
        if not waits:
            return True
        self.inbox.add(self.transport.poll(), self.step)
        return not self.inbox.take([signals.expected(self.step, s, kind, peer)
                                    for s, kind, peer in waits])

    def _sync(self) -> None:
        """Wait for the packs/unpacks queued on this rank's current CUDA stream (async
        kernels; a peer must not read or overwrite their staging before they finish).
        Only that stream: a transport's copies of earlier writes may still be running.
        Nothing to do when this rank queued nothing there since its last sync (`queued`):
        a target whose weights arrive by a peer's writes alone, a source without packs."""
        if self.device.type == "cuda" and self.queued:
            t0 = time.perf_counter()
            torch.cuda.current_stream(self.device).synchronize()
            self.waited += time.perf_counter() - t0
        self.queued = False

    def _msg(self, peer: int, stage: int, kind: int) -> bytes:
        self.seq += 1
        return signals.encode(self.keys, self.tag, self.incarnation,
                              self.inbox.incarnations.get(peer, 0), self.step, stage, kind,
                              self.rank, self.seq)

    def _signal(self, peers: list[int], stage: int, kind: int) -> None:
        for peer in peers:
            try:
                self.transport.notify(peer, self._msg(peer, stage, kind))
            except Exception as e:  # transports raise their own types
                raise PeerLostError(self.rank, peer, f"send {_KIND_NAMES[kind]} of stage "
                                    f"{stage}", e) from e

    def _wait(self, waits: list[tuple[int, int, int]], timeout_s: float | None) -> None:
        if not waits:
            return
        keys = [signals.expected(self.step, s, kind, peer) for s, kind, peer in waits]
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.blame.start(timeout_s)
        backoff, t0 = Backoff(), time.perf_counter()
        try:
            self._poll_until(keys, backoff, timeout_s)
        finally:
            self.waited += time.perf_counter() - t0

    def _poll_until(self, keys: list[signals.Key], backoff: Backoff, timeout_s: float) -> None:
        self.inbox.add(self.transport.poll(), self.step)
        missing, polled = keys, True  # signals may also have arrived before this wait
        while True:
            if polled:
                if self.inbox.foreign:  # a restarted peer already signals: import it now
                    self.recovery.refresh_peers()
                missing = self.inbox.take(keys)
                if not missing:
                    return
                if (aborted := self.inbox.abort_of(self.step, missing)) is not None:
                    raise PeerAbortError(self.rank, aborted[0], aborted[1], self.step)
            if self.blame.expired():
                _, stage, kind, peer = missing[0]
                culprit = self.blame.culprit(peer)
                what = f"send {_KIND_NAMES[kind]} of stage {stage}, step {self.step}"
                if culprit != peer:
                    what = (f"take part in step {self.step} (rank {peer}, which this rank "
                            f"waits for, is alive and waits itself; rank {culprit}'s "
                            "heartbeat stopped)")
                raise PeerTimeoutError(self.rank, culprit, what, timeout_s)
            backoff.pause()  # spins briefly, then naps a share of the wait (spin.py)
            msgs = self.transport.poll()
            if polled := bool(msgs):  # nothing new: nothing to match again
                self.inbox.add(msgs, self.step)

