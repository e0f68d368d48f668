"""Signal messages and the inbox that matches them to waits.

A message is `b"RPS1"` + 8 bytes of the plan fingerprint's hash + (step, stage, kind,
sender). Waits match the rule of `schemas/plan.py`: a `READY` or `DONE` wait at stage s
matches the peer's signal sent in stage s of the same step, an `ACK` wait at stage s the
peer's `ACK` sent in stage s-1. Messages of another plan are ignored, messages of an
earlier step are stale and dropped, messages of a later step are kept for it.
"""

from __future__ import annotations

import hashlib
import struct

from schemas.plan import ACK

_MAGIC = b"RPS1"
_BODY = struct.Struct("<qiBi")

Key = tuple[int, int, int, int]
"""(step, stage sent in, kind, sender)."""


def fingerprint_tag(fingerprint: object) -> bytes:
    return hashlib.blake2b(str(fingerprint).encode(), digest_size=8).digest()


def encode(tag: bytes, step: int, stage: int, kind: int, sender: int) -> bytes:
    return _MAGIC + tag + _BODY.pack(step, stage, kind, sender)


def expected(step: int, wait_stage: int, kind: int, peer: int) -> Key:
    """The key of the signal that satisfies a wait at `wait_stage` (see the module doc)."""
    return (step, wait_stage - 1 if kind == ACK else wait_stage, kind, peer)


class Inbox:
    def __init__(self, tag: bytes) -> None:
        self.tag = tag
        self.arrived: set[Key] = set()

    def add(self, msgs: list[bytes], step: int) -> None:
        for m in msgs:
            if len(m) != 12 + _BODY.size or m[:4] != _MAGIC or m[4:12] != self.tag:
                continue
            key = _BODY.unpack(m[12:])
            if key[0] >= step:
                self.arrived.add(key)

    def take(self, keys: list[Key]) -> list[Key]:
        """Consume the keys that arrived; return those still missing."""
        missing = [k for k in keys if k not in self.arrived]
        if not missing:
            self.arrived.difference_update(keys)
        return missing

    def drop_before(self, step: int) -> None:
        self.arrived = {k for k in self.arrived if k[0] >= step}
