"""Signal messages and the inbox that matches them to waits.

A message is `b"RPS2"` + 8 bytes of the plan fingerprint's hash + (sender's incarnation,
receiver's incarnation as the sender imported it, step, stage, kind, sender). Waits match
the rule of `schemas/plan.py`: a `READY` or `DONE` wait at stage s matches the peer's
signal sent in stage s of the same step, an `ACK` wait at stage s the peer's `ACK` sent in
stage s-1. Messages of another plan are ignored, messages of an earlier step are stale and
dropped, messages of a later step are kept for it. An `ABORT` (executor-internal) says the
sender gave up the step after losing a rank: its signals of that step received so far are
void (it may run the step again and send them again), and if the lost rank is another one,
waits on the sender fail at once, naming it.

Incarnations (executor/core.py, recovery): a message counts only if it is addressed to this
process (not to an earlier process of this rank: the sender's writes went there) and its
sender's incarnation is the one imported for the sender. Messages of any other sender
incarnation never satisfy a wait: they are held (a bounded number), `foreign` is set so
that the executor reads the store for a restarted peer, and `set_incarnation` admits the
held ones of the newly imported one.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque

from schemas.protocol import sent_stage

_MAGIC = b"RPS2"
_BODY = struct.Struct("<QQqiBi")
_HELD = 4096  # messages of unknown incarnations kept for a peer being re-imported
ABORT = 255
"""Executor-internal kind (not in plans): the sender gave up this step because it lost the
rank in the message's stage field; a rank waiting for the sender stops waiting."""

Key = tuple[int, int, int, int]
"""(step, stage sent in, kind, sender)."""


def fingerprint_tag(fingerprint: object) -> bytes:
    return hashlib.blake2b(str(fingerprint).encode(), digest_size=8).digest()


def encode(tag: bytes, incarnation: int, to: int, step: int, stage: int, kind: int,
           sender: int) -> bytes:
    """`incarnation`: the sender's; `to`: the receiver's, as the sender imported it."""
    return _MAGIC + tag + _BODY.pack(incarnation, to, step, stage, kind, sender)


def expected(step: int, wait_stage: int, kind: int, peer: int) -> Key:
    """The key of the signal that satisfies a wait at `wait_stage` (see the module doc)."""
    return (step, sent_stage(kind, wait_stage), kind, peer)


class Inbox:
    def __init__(self, tag: bytes, incarnation: int = 0, rank: int = -1) -> None:
        self.tag, self.incarnation, self.rank = tag, incarnation, rank
        self.arrived: set[Key] = set()
        self.incarnations: dict[int, int] = {}
        """Sender rank -> the incarnation imported for it."""
        self.held: deque[tuple[int, Key]] = deque(maxlen=_HELD)
        self.foreign = False
        """A message of an incarnation other than the imported one arrived."""
        self.aborted: dict[int, tuple[int, int]] = {}
        """Sender -> (step, lost rank) of the `ABORT`s that arrived."""

    def set_incarnation(self, peer: int, incarnation: int) -> None:
        """`peer` is now the process `incarnation`: admit its held messages."""
        self.incarnations[peer] = incarnation
        keep: deque[tuple[int, Key]] = deque(maxlen=_HELD)
        for inc, key in self.held:
            if key[3] == peer and inc == incarnation:
                self.arrived.add(key)
            elif key[3] != peer:
                keep.append((inc, key))
        self.held = keep

    def add(self, msgs: list[bytes], step: int) -> None:
        for m in msgs:
            if len(m) != 12 + _BODY.size or m[:4] != _MAGIC or m[4:12] != self.tag:
                continue
            inc, to, *rest = _BODY.unpack(m[12:])
            key: Key = tuple(rest)  # type: ignore[assignment]
            if key[0] < step or to != self.incarnation:
                continue  # stale, or meant for an earlier process of this rank
            if self.incarnations.get(key[3]) != inc:
                self.held.append((inc, key))
                self.foreign = True
                continue
            if key[2] == ABORT:  # the sender's signals of that step are void (it runs again)
                self.arrived = {k for k in self.arrived
                                if not (k[3] == key[3] and k[0] == key[0])}
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

    def take(self, keys: list[Key]) -> list[Key]:
        """Consume the keys that arrived; return those still missing."""
        missing = [k for k in keys if k not in self.arrived]
        if not missing:
            self.arrived.difference_update(keys)
        return missing

    def drop_before(self, step: int) -> None:
        self.arrived = {k for k in self.arrived if k[0] >= step}
        self.aborted = {s: a for s, a in self.aborted.items() if a[0] >= step}
        self.held = deque(((i, k) for i, k in self.held if k[0] >= step), maxlen=_HELD)
