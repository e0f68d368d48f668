"""A step's signal path as the executor runs it between processes of one host: messages
sealed by `Sealer` (what `encode` makes), checked by `Inbox.add` with its held MAC (a forged,
replayed or stale one never satisfies a wait), awaited by `Signals.wait` over real
shared-memory rings (`ShmMailbox`), which asks `Blame` only from `Blame.due` on and still
times out with one line naming the peer."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from executor import signals
from executor.auth import keys_from
from executor.blame import Blame
from executor.control import LEASE_S
from executor.errors import PeerAbortError, PeerTimeoutError
from executor.transports.shm_mailbox import ShmMailbox
from executor.waits import Sender, Signals
from schemas.plan import DONE, READY

SECRET = os.urandom(32)
TAG = signals.fingerprint_tag("plan-a")


class _Leases:
    """A control whose every peer lease is missing (no store)."""

    def alive_record(self, rank: int) -> None:
        return None


class _Transport:
    def __init__(self, mailbox: ShmMailbox) -> None:
        self.poll, self.notify = mailbox.poll, mailbox.notify


@pytest.fixture
def pair():
    """Rank 0 and rank 1's `Signals` over two real shared-memory rings."""
    a, b = ShmMailbox(0, "sigpath"), ShmMailbox(1, "sigpath")
    a.import_peer(1, b.export())
    b.import_peer(0, a.export())
    out = []
    for rank, mailbox, inc in ((0, a, 11), (1, b, 22)):
        keys = keys_from(SECRET, rank=rank)
        inbox = signals.Inbox(TAG, inc, rank, keys)
        inbox.set_incarnation(1 - rank, 33 - inc, mailbox.peer_id(1 - rank))
        out.append(Signals(Sender(rank, TAG, inc, keys, torch.device("cpu")),
                           _Transport(mailbox), inbox, Blame(_Leases(), 2, rank, live=False),
                           lambda: None))
    yield out
    a.close()
    b.close()


@pytest.mark.parametrize("secure", [True, False])
def test_sealer_makes_what_encode_makes(secure):
    keys = keys_from(SECRET if secure else None, insecure=not secure)
    fields = (0x1234, 0x5678, 7, 2, READY, 3, 99)
    got = signals.Sealer(keys, TAG).seal(*fields)
    assert got == signals.encode(keys, TAG, *fields)
    assert len(got) == signals.SIZE


def test_inbox_admits_sealed_and_refuses_forged_replayed_stale():
    keys = keys_from(SECRET)
    inbox = signals.Inbox(TAG, 22, 1, keys)
    inbox.set_incarnation(0, 11)
    seal = signals.Sealer(keys, TAG).seal
    good = seal(11, 22, 5, 0, READY, 0, 1)
    forged = good[:-1] + bytes([good[-1] ^ 1])
    inbox.add([("shm:0", forged)], 5)
    assert inbox.refused == 1 and not inbox.arrived  # a wrong MAC satisfies nothing
    other = signals.Sealer(keys_from(os.urandom(32)), TAG).seal(11, 22, 5, 0, READY, 0, 2)
    inbox.add([("shm:0", other)], 5)
    assert inbox.refused == 2 and not inbox.arrived  # another job's secret
    inbox.add([("shm:0", good)], 5)
    assert inbox.take([(5, 0, READY, 0)]) == []
    inbox.add([("shm:0", good)], 5)  # the same message again
    assert inbox.refused == 3 and inbox.take([(5, 0, READY, 0)]) == [(5, 0, READY, 0)]
    inbox.add([("shm:0", seal(11, 22, 4, 0, READY, 0, 3))], 5)  # an earlier step's
    assert not inbox.arrived and inbox.refused == 3
    inbox.add([("shm:0", seal(11, 99, 5, 0, READY, 0, 4))], 5)  # to another process
    assert not inbox.arrived
    inbox.add([("shm:0", seal(12, 22, 5, 0, READY, 0, 5))], 5)  # a restarted sender
    assert inbox.foreign and not inbox.arrived


def test_a_message_sealed_ahead_is_admitted_by_its_bytes_and_still_checked():
    keys = keys_from(SECRET)
    inbox = signals.Inbox(TAG, 22, 1, keys)
    inbox.set_incarnation(0, 11, "shm:0")
    seal = signals.Sealer(keys, TAG).seal
    key = (5, 0, READY, 0)
    inbox.expect([key])  # rank 0's next message (its first: sequence number 1)
    good = seal(11, 22, 5, 0, READY, 0, 1)
    assert inbox.expecting[key] == good  # what the sender seals, byte for byte
    inbox.add([("shm:7", good)], 5)  # the right bytes from another sender's ring
    assert inbox.refused == 1 and not inbox.arrived and inbox.ahead_hits == 0
    inbox.expect([key])
    inbox.add([("shm:0", good[:-1] + bytes([good[-1] ^ 1]))], 5)  # a MAC off by one bit
    assert inbox.refused == 2 and not inbox.arrived
    inbox.add([("shm:0", good)], 5)
    assert inbox.ahead_hits == 1 and inbox.take([key]) == [] and not inbox.expecting
    inbox.add([("shm:0", good)], 5)  # replayed: checked in full, refused
    assert inbox.refused == 3 and not inbox.arrived and inbox.ahead_hits == 1
    inbox.expect([(6, 0, READY, 0)])
    inbox.add([("shm:0", seal(11, 22, 6, 0, READY, 0, 3))], 6)  # the sender sent another first
    assert inbox.take([(6, 0, READY, 0)]) == [] and inbox.ahead_hits == 1  # the full check
    inbox.expect([(7, 0, READY, 0)])
    inbox.drop_before(8)  # a later step: a guess for an earlier one is gone
    assert not inbox.expecting and not inbox.expected
    inbox.add([("shm:0", seal(11, 22, 7, 0, READY, 0, 4))], 8)
    assert not inbox.arrived and inbox.refused == 3  # stale, dropped as any
    inbox.expect([(8, 0, READY, 0)])
    inbox.set_incarnation(0, 12, "shm:0")  # a restarted sender: no guess of the old one holds
    assert not inbox.expected


def test_signals_seal_the_next_ready_ahead_as_msg_would(pair):
    _, dst = pair
    dst.head([(0, 0, READY)], [])
    dst.begin(5)
    dst.ahead()  # idle time late in step 5: step 6's READY to rank 0, sealed
    dst.begin(6)
    first = dst.msg(0, 0, READY)
    assert dst.sent_ahead == 1
    assert first == signals.encode(dst.me.keys, TAG, 22, 11, 6, 0, READY, 1, dst.seq)
    dst.ahead()
    dst.begin(9)  # the caller skipped steps: sealed when sent
    assert dst.msg(0, 0, READY) == signals.encode(dst.me.keys, TAG, 22, 11, 9, 0, READY, 1,
                                                  dst.seq)
    assert dst.sent_ahead == 1
    dst.ahead()
    other = signals.fingerprint_tag("plan-b")
    dst.retag(other)  # a plan switch between steps: nothing sealed under the old tag goes out
    dst.begin(10)
    assert dst.msg(0, 0, READY) == signals.encode(dst.me.keys, other, 22, 11, 10, 0, READY, 1,
                                                  dst.seq)
    assert dst.sent_ahead == 1


def test_steady_steps_hand_off_through_what_was_sealed_ahead(pair):
    """Steps as a source (rank 0) and a target (rank 1) run them: after the first, every
    READY is sent as sealed ahead and admitted by its bytes, every DONE too."""
    src, dst = pair
    src.head([], [(0, READY, 1)])
    dst.head([(0, 0, READY)], [])
    for step in range(1, 6):
        src.begin(step)
        dst.begin(step)
        dst.send([0], 0, READY)
        src.wait([(0, READY, 1)], 5.0)
        late = threading.Timer(0.02, src.send, ([1], 0, DONE))  # the writes land later
        late.start()
        dst.wait([(0, DONE, 0)], 5.0)  # idle first: expects the DONE, seals the next READY
        late.join()
        src.ahead()  # as its window does while the writes are in flight
    assert dst.sent_ahead == 4 and src.inbox.ahead_hits == 4 and dst.inbox.ahead_hits == 5
    assert src.inbox.refused == dst.inbox.refused == 0


def test_wait_returns_on_a_signal_sent_between_processes_rings(pair):
    src, dst = pair
    for step in (1, 2, 3):
        src.begin(step)
        dst.begin(step)
        dst.send([0], 0, READY)
        src.wait([(0, READY, 1)], 5.0)  # stage 0's READY of rank 1
        src.send([1], 0, DONE)
        dst.wait([(0, DONE, 0)], 5.0)


def test_wait_times_out_naming_the_peer(pair):
    src, _ = pair
    src.begin(1)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=r"^rank 0: peer rank 1 did not send READY of "
                       r"stage 0, step 1 within 0.05 s") as e:
        src.wait([(0, READY, 1)], 0.05)
    assert e.value.peer == 1
    assert time.monotonic() - t0 < 30  # a bound, not a timing: it did not hang


def test_wait_stops_at_a_peer_abort(pair):
    src, dst = pair
    src.begin(1)
    dst.begin(1)
    dst.transport.notify(0, dst.msg(0, 2, signals.ABORT))  # rank 1 lost rank 2
    with pytest.raises(PeerAbortError):
        src.wait([(0, READY, 1)], 5.0)


def test_blame_due_is_when_expired_can_first_change():
    blame = Blame(_Leases(), 3, 0, live=False)
    blame.start(0.2)
    assert blame.due() == blame.deadline
    assert not blame.expired()
    live = Blame(_Leases(), 3, 0)
    live.start(100.0)
    assert live.due() == live.snap_at <= live.deadline
    assert not live.expired() and live.snap is None  # nothing read before its moment
    live.start(0.0)  # times out now: the snapshot, then a lease period more
    assert live.due() <= time.monotonic()
    assert not live.expired() and live.snap is not None
    assert live.due() == max(live.deadline, live.snap_t + LEASE_S)
    assert time.monotonic() < live.due()
