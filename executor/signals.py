"""Signal messages and the inbox that matches them to waits.

A message (69 bytes) is `b"RPS3"` + 8 bytes of the plan fingerprint's hash + (sender's
incarnation, receiver's incarnation as the sender imported it, step, stage, kind, sender,
the sender process's sequence number) + a 16-byte MAC. Waits match the rule of
`schemas/plan.py`: a `READY` or `DONE` wait at stage s matches the peer's signal sent in
stage s of the same step, an `ACK` wait at stage s the peer's `ACK` sent in stage s-1, a
`SLOT_ACK` wait the peer's `SLOT_ACK` sent in stage s-SLOTS. Messages of another plan are
ignored, messages of an earlier step are stale and dropped, messages of a later step are
kept for it. An `ABORT` (executor-internal) says the sender gave up the step after losing a
rank: its signals of that step received so far are void (it may run the step again and send
them again), and if the lost rank is another one, waits on the sender fail at once, naming
it.

Incarnations (executor/core.py, recovery): a message counts only if it is addressed to this
process (not to an earlier process of this rank: the sender's writes went there) and its
sender's incarnation is the one imported for the sender. Messages of any other sender
incarnation never satisfy a wait: they are held (a bounded number), `foreign` is set so that
the executor reads the store for a restarted peer, and `set_incarnation` admits the held
ones of the newly imported one.

Authentication (`auth.py`): every message ends in a 16-byte MAC under the job's signal key
and carries a per-process sequence number. A message is refused (dropped, counted in
`refused`, logged) when its MAC is wrong (forged), its sequence number was seen before
(replayed), or the transport-level sender (e.g. the NIXL agent it came from) is not the one
imported for the rank it claims (impersonation). Refused messages never satisfy a wait, void
a READY or make a rank re-read the store.

Checked ahead (`Inbox.expect`): in a step's idle time (a wait with nothing arrived yet, the
writes in flight) a receiver seals the message a sender will send next for a key (its
fields, the sender's next sequence number, the MAC under the job's key) as the sender will.
`add` admits a message equal to it byte for byte: the same bytes carry the same MAC, plan
tag, incarnations, step, stage, kind and sender, so what a full check proves (the MAC, the
addressee, the sender's imported incarnation) is proven by the equality; the transport-level
sender, staleness and the sequence number (replay) are still checked at arrival. A message
that differs from every expected one is checked in full: a prediction that misses costs
only the idle time it took."""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
from collections import deque

from schemas.protocol import sent_stage

from .auth import SIG_MAC, Keys, sign, signal_mac, verify

log = logging.getLogger("executor")
_MAGIC = b"RPS3"
_BODY = struct.Struct("<QQqiBiQ")
SIZE = 12 + _BODY.size + SIG_MAC
_SEEN = 4096  # sequence numbers remembered per sender (replay window)
_HELD = 4096  # messages of unknown incarnations kept for a peer being re-imported
_EXPECTED = 256  # messages sealed ahead (`Inbox.expect`) kept at most
ABORT = 255
"""Executor-internal kind (not in plans): the sender gave up this step because it lost the
rank in the message's stage field; a rank waiting for the sender stops waiting."""

Key = tuple[int, int, int, int]
"""(step, stage sent in, kind, sender)."""


def fingerprint_tag(fingerprint: object) -> bytes:
    return hashlib.blake2b(str(fingerprint).encode(), digest_size=8).digest()


def encode(keys: Keys, tag: bytes, incarnation: int, to: int, step: int, stage: int,
           kind: int, sender: int, seq: int) -> bytes:
    """`incarnation`: the sender's; `to`: the receiver's, as the sender imported it; `seq`:
    the sender process's message counter (never repeats)."""
    return sign(keys, _MAGIC + tag + _BODY.pack(incarnation, to, step, stage, kind, sender,
                                               seq))


class Sealer:
    """`encode` for one sender, with what every message of it shares made once (the plan's
    prefix, the keyed MAC): a message sealed on a step's path is one pack, one MAC."""

    __slots__ = ("prefix", "mac", "pack")

    def __init__(self, keys: Keys, tag: bytes) -> None:
        self.prefix = _MAGIC + tag
        self.mac = signal_mac(keys)
        self.pack = _BODY.pack

    def seal(self, incarnation: int, to: int, step: int, stage: int, kind: int, sender: int,
             seq: int) -> bytes:
        """What `encode` returns for these fields under this sender's keys and tag."""
        msg = self.prefix + self.pack(incarnation, to, step, stage, kind, sender, seq)
        if self.mac is None:
            return msg + bytes(SIG_MAC)
        h = self.mac.copy()
        h.update(msg)
        return msg + h.digest()


def expected(step: int, wait_stage: int, kind: int, peer: int) -> Key:
    """The key of the signal that satisfies a wait at `wait_stage` (see the module doc)."""
    return (step, sent_stage(kind, wait_stage), kind, peer)


class Inbox:
    def __init__(self, tag: bytes, incarnation: int = 0, rank: int = -1,
                 keys: Keys | None = None) -> None:
        self.tag, self.incarnation, self.rank = tag, incarnation, rank
        self.prefix = _MAGIC + tag  # what every message of this plan starts with
        self.keys = keys or Keys(None, None, None)
        self.mac = signal_mac(self.keys)  # each message's MAC copies it
        self.arrived: set[Key] = set()
        self.incarnations: dict[int, int] = {}
        """Sender rank -> the incarnation imported for it."""
        self.senders: dict[int, str] = {}
        """Sender rank -> its transport-level identity (e.g. NIXL agent name), if known."""
        self.held: deque[tuple[int, str, Key]] = deque(maxlen=_HELD)
        self.foreign = False
        """A message of an incarnation other than the imported one arrived."""
        self.aborted: dict[int, tuple[int, int]] = {}
        """Sender -> (step, lost rank) of the `ABORT`s that arrived."""
        self.seen: dict[tuple[int, int], set[int]] = {}
        """(sender, incarnation) -> sequence numbers seen (replay window)."""
        self.high: dict[tuple[int, int], int] = {}
        self.refused = 0
        self.last_refused = ""
        self.expected: dict[bytes, tuple[Key, int, int]] = {}
        """A message sealed ahead (`expect`) -> (its key, its sender's incarnation, its
        sequence number)."""
        self.expecting: dict[Key, bytes] = {}
        """The keys sealed ahead, each to its message."""
        self.expect_low = 0
        """No key of `expecting` is of an earlier step."""
        self.ahead_hits = 0
        """Messages admitted by their bytes (`expect`); the rest were checked in full."""

    def retag(self, tag: bytes) -> None:
        """The rank switched plans between steps: only the new plan's messages count. What
        arrived already (of a later step: a peer that went on with the old plan) is the old
        plan's: dropped, never taken for the new plan's wait of the same key (a key does
        not carry the plan's tag)."""
        self.tag, self.prefix = tag, _MAGIC + tag
        self.arrived.clear()
        self.forget_expected()

    def expect(self, keys: list[Key]) -> None:
        """Seal ahead, for each of `keys` not expected yet, the message its sender sends if it
        is that sender's next one (sequence number one past the highest seen from its
        imported incarnation): `add` admits exactly those bytes without a MAC computation
        (see the module doc). Idle-time work: a key whose sender sends something else first
        is checked in full when it comes."""
        for key in keys:
            step, stage, kind, sender = key
            inc = self.incarnations.get(sender)
            if inc is None:
                continue
            seq = self.high.get((sender, inc), 0) + 1
            old = self.expecting.get(key)
            if old is not None:
                if self.expected[old][1:] == (inc, seq):
                    continue  # sealed ahead already, still that sender's next
                del self.expected[self.expecting.pop(key)]  # a guess its sender overtook
            if len(self.expected) >= _EXPECTED:
                self.forget_expected()
            m = self.prefix + _BODY.pack(inc, self.incarnation, step, stage, kind, sender, seq)
            if self.mac is None:
                m += bytes(SIG_MAC)
            else:
                h = self.mac.copy()
                h.update(m)
                m += h.digest()
            self.expected[m] = (key, inc, seq)
            if not self.expecting or step < self.expect_low:
                self.expect_low = step
            self.expecting[key] = m

    def forget_expected(self) -> None:
        """Drop every message sealed ahead (an incarnation or the plan's tag changed)."""
        self.expected.clear()
        self.expecting.clear()

    def set_incarnation(self, peer: int, incarnation: int, sender_id: str = "") -> None:
        """`peer` is now the process `incarnation` (transport identity `sender_id`): admit
        its held messages that came from that identity."""
        self.forget_expected()
        self.incarnations[peer] = incarnation
        if sender_id:
            self.senders[peer] = sender_id
        keep: deque[tuple[int, str, Key]] = deque(maxlen=_HELD)
        for inc, sid, key in self.held:
            if key[3] == peer and inc == incarnation and self._from(peer, sid):
                self._admit(key)
            elif key[3] != peer:
                keep.append((inc, sid, key))
        self.held = keep

    def clear_foreign(self) -> None:
        """Every peer whose other incarnation signalled has been looked at (re-imported, or
        its record refused): `foreign` is clear until another such message arrives."""
        self.foreign = False

    def _from(self, peer: int, sender_id: str) -> bool:
        want = self.senders.get(peer, "")
        return not want or not sender_id or sender_id == want

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self.last_refused = f"rank {self.rank}: refused a signal: {why}"
        if self.refused <= 16 or self.refused % 1000 == 0:
            log.warning("%s (%d refused so far)", self.last_refused, self.refused)

    def _fresh(self, sender: int, inc: int, seq: int) -> bool:
        """Whether message `seq` of that process is new (a window of `_SEEN` numbers)."""
        high = self.high.get((sender, inc), 0)
        seen = self.seen.setdefault((sender, inc), set())
        if seq in seen or seq + _SEEN < high:
            return False
        seen.add(seq)
        if seq > high:
            self.high[(sender, inc)] = high = seq
        if len(seen) > 2 * _SEEN:
            seen.difference_update([q for q in seen if q + _SEEN < high])
        return True

    def add(self, msgs: list[tuple[str, bytes]], step: int) -> None:
        """Take the messages a transport polled: (transport-level sender, message)."""
        prefix, mac, expected = self.prefix, self.mac, self.expected
        for sender_id, m in msgs:
            ahead = expected.pop(m, None) if expected else None
            if ahead is not None:  # sealed ahead by this rank: MAC, addressee, incarnation
                key, inc, seq = ahead
                del self.expecting[key]
                if key[0] >= step and self._from(key[3], sender_id) and \
                        self._fresh(key[3], inc, seq):
                    self.arrived.add(key)
                    self.ahead_hits += 1
                    continue
                # stale: dropped below as any; else refused below, naming why
            if len(m) != SIZE or m[:12] != prefix:
                continue  # not ours, or another plan's (refused at connect)
            inc, to, step_, stage, kind, sender, seq = _BODY.unpack_from(m, 12)
            if mac is not None:  # `auth.verify`, with the keyed hash held here
                h = mac.copy()
                h.update(m[:-SIG_MAC])
                good = hmac.compare_digest(h.digest(), m[-SIG_MAC:])
            else:
                good = verify(self.keys, m)
            if not good:
                self._refuse(f"forged: kind {kind} from 'rank {sender}' (step {step_}, "
                             f"stage {stage}) does not carry the job secret's MAC")
                continue
            if step_ < step or to != self.incarnation:
                continue  # stale, or meant for an earlier process of this rank
            key: Key = (step_, stage, kind, sender)
            if self.incarnations.get(sender) != inc:
                self.held.append((inc, sender_id, key))
                self.foreign = True
                continue
            if not self._from(sender, sender_id):
                self._refuse(f"impersonation: claims rank {sender} but came from "
                             f"{sender_id!r}, not {self.senders[sender]!r}")
                continue
            if not self._fresh(sender, inc, seq):
                self._refuse(f"replayed: message {seq} of rank {sender} arrived before")
                continue
            if kind == ABORT:
                self._admit(key)
            else:
                self.arrived.add(key)

    def _admit(self, key: Key) -> None:
        if key[2] == ABORT:  # the sender's signals of that step are void (it runs again)
            self.arrived = {k for k in self.arrived if not (k[3] == key[3] and k[0] == key[0])}
            if key[1] != self.rank:  # it lost another rank: waits on it fail now
                self.aborted[key[3]] = (key[0], key[1])
        else:
            self.arrived.add(key)

    def abort_of(self, step: int, missing: list[Key]) -> tuple[int, int] | None:
        """(sender, lost rank) if a sender of a missing key aborted step `step`."""
        for k in missing:
            got = self.aborted.get(k[3])
            if got is not None and got[0] == step:
                return k[3], got[1]
        return None

    def abort_any(self, step: int) -> tuple[int, int] | None:
        """(sender, lost rank) of any `ABORT` of step `step` (the first that arrived)."""
        for sender, (s, lost) in self.aborted.items():
            if s == step:
                return sender, lost
        return None

    def take(self, keys: list[Key]) -> list[Key]:
        """Consume the keys that arrived; return those still missing."""
        missing = [k for k in keys if k not in self.arrived]
        if not missing:
            self.arrived.difference_update(keys)
        return missing

    def drop_before(self, step: int) -> None:
        if self.arrived:  # each is nearly always empty between steps: nothing to rebuild
            self.arrived = {k for k in self.arrived if k[0] >= step}
        if self.aborted:
            self.aborted = {s: a for s, a in self.aborted.items() if a[0] >= step}
        if self.held:
            self.held = deque(((i, d, k) for i, d, k in self.held if k[0] >= step),
                              maxlen=_HELD)
        if self.expecting and self.expect_low < step:
            for k in [k for k in self.expecting if k[0] < step]:
                del self.expected[self.expecting.pop(k)]
            self.expect_low = min((k[0] for k in self.expecting), default=step)
