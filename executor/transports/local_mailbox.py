"""The `local` transport's mailboxes: one per rank, many senders, one reader.

A message is delivered exactly once under any interleaving of its senders and its reader:
`put` appends under the mailbox's lock, `take` swaps the whole contents out under the same
lock. (A reader that copied the list and then cleared it, two steps, would lose a message
appended between them: its wait would time out although every byte had landed.)

`Mailbox` serves ranks that are threads of one process. `SharedMailbox` serves ranks that
are processes forked after `connect` (`Fabric(shared=True)`): a ring of `SLOTS` messages
in an anonymous shared mapping, its head and tail guarded by a process-shared semaphore
(which also orders the sender's earlier copies into shared memory before the message, for
the reader that takes it). Both must be created before the fork: a mailbox made later is
private to the process that made it.
"""

from __future__ import annotations

import mmap
import multiprocessing
import struct
import threading
import time

SLOTS = 4096
PAYLOAD = 120
_HEAD = struct.Struct("<QQ")  # messages put, messages taken
_SLOT = struct.Struct("<qQ")  # sender rank, length
_SLOT_BYTES = _SLOT.size + PAYLOAD


class Mailbox:
    """A rank's mailbox for senders that are threads of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._msgs: list[tuple[int, bytes]] = []

    def put(self, sender: int, msg: bytes) -> None:
        with self._lock:
            self._msgs.append((sender, msg))

    def take(self) -> list[tuple[int, bytes]]:
        """Every message put so far and not taken yet, in the order put."""
        if not self._msgs:  # a hint only: a message put meanwhile is taken next time
            return []
        with self._lock:
            msgs, self._msgs = self._msgs, []
        return msgs


class SharedMailbox:
    """A rank's mailbox in shared memory, for senders in processes forked after it exists."""

    def __init__(self, slots: int = SLOTS, timeout_s: float = 60.0) -> None:
        self.slots, self.timeout_s = slots, timeout_s
        self._lock = multiprocessing.get_context("fork").Lock()
        self._map = mmap.mmap(-1, _HEAD.size + slots * _SLOT_BYTES)  # MAP_SHARED

    def put(self, sender: int, msg: bytes) -> None:
        if len(msg) > PAYLOAD:
            raise ValueError(f"local transport: a message of {len(msg)} bytes from rank "
                             f"{sender}; at most {PAYLOAD} fit a shared mailbox slot")
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._lock:
                head, tail = _HEAD.unpack_from(self._map, 0)
                if head - tail < self.slots:
                    at = _HEAD.size + (head % self.slots) * _SLOT_BYTES
                    _SLOT.pack_into(self._map, at, sender, len(msg))
                    self._map[at + _SLOT.size:at + _SLOT.size + len(msg)] = msg
                    _HEAD.pack_into(self._map, 0, head + 1, tail)
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"local transport: rank {sender}'s message found the "
                                   f"receiver's {self.slots} mailbox slots unread for "
                                   f"{self.timeout_s:g} s (is the receiving rank running?)")
            time.sleep(1e-4)

    def take(self) -> list[tuple[int, bytes]]:
        """Every message put so far and not taken yet, in the order put."""
        head, tail = _HEAD.unpack_from(self._map, 0)
        if head == tail:  # a hint only (read unlocked): a message put meanwhile comes next
            return []
        msgs = []
        with self._lock:
            head, tail = _HEAD.unpack_from(self._map, 0)
            for seq in range(tail, head):
                at = _HEAD.size + (seq % self.slots) * _SLOT_BYTES
                sender, n = _SLOT.unpack_from(self._map, at)
                msgs.append((sender, bytes(self._map[at + _SLOT.size:at + _SLOT.size + n])))
            _HEAD.pack_into(self._map, 0, head, head)
        return msgs
