"""Notifications between processes of one host through shared memory (`/dev/shm`).

One file per (sender, receiver) pair, named after both processes' random tokens (so a
restarted process never reads an old mailbox): a single-producer single-consumer ring of
`SLOTS` messages of at most `PAYLOAD` bytes, with the sender's and the receiver's
sequence numbers in the first 16 bytes. The sender writes the message, then its sequence
number; the receiver reads the sequence number, then the messages (8-byte aligned stores
through ctypes, ordered on x86-64). A message takes microseconds, where a TCPStore round
trip and a polling nap take far longer: what the `cuda_ipc` transport's READY/DONE/ACK
handshakes cost per stage. Both sides create the file if it is not there yet (whoever
comes first) and unlink it at `close()`; a crashed process leaves its files behind
(132 KiB each).

A message can also be *staged* (`stage`): written into its slot, but published by whoever
later writes the returned value into the ring's head, i.e. the GPU, once the copies the
message announces have landed (`cuda_ipc`'s DONE without a host in between; the file is
whole pages so that the sender can pin and map it for the GPU, `ring_memory`). Staged
messages must be published in the order they were staged; a `notify` to that peer waits
until they are (a ring has one writer at a time).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pathlib
import secrets
import struct
import time
from collections.abc import Callable

_LEN = struct.Struct("<Q")
SLOTS = 1024
PAYLOAD = 120
_SLOT = 8 + PAYLOAD
_SIZE = -(-(64 + SLOTS * _SLOT) // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages (pinnable)
DIR = "/dev/shm"


class _Ring:
    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self.map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self.path = path
        self.head = ctypes.c_uint64.from_buffer(self.map, 0)  # messages published
        self.tail = ctypes.c_uint64.from_buffer(self.map, 8)  # messages read
        self.sent = self.head.value  # messages written by this process (staged ones too)
        first = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(first)  # of the mapping (head at offset 0)
        del first  # an exported buffer would keep `close` from unmapping
        self.unpin: Callable[[], None] | None = None
        """Undoes the sender's pinning of this ring for the GPU (`ring_memory`), if any."""

    def close(self) -> None:
        if self.unpin is not None:
            self.unpin()
            self.unpin = None
        del self.head, self.tail
        self.map.close()
        pathlib.Path(self.path).unlink(missing_ok=True)  # the other side may have unlinked it


class ShmMailbox:
    """`notify(peer, msg)` / `poll()` for peers on this host (their `export()` token)."""

    def __init__(self, rank: int, namespace: str, timeout_s: float = 60.0) -> None:
        self.rank, self.ns, self.timeout_s = rank, namespace, timeout_s
        self.token = secrets.token_hex(8)
        self.out: dict[int, _Ring] = {}
        self.inbox: dict[int, _Ring] = {}
        self.ids: dict[int, str] = {}  # peer -> its `peer_id`

    def export(self) -> dict[str, str]:
        return {"token": self.token, "host": os.uname().nodename}

    def _path(self, sender: int, s_token: str, receiver: int, r_token: str) -> str:
        return os.path.join(DIR, f"rplan-{self.ns}-{sender}-{s_token}-{receiver}-{r_token}")

    def import_peer(self, peer: int, desc: dict[str, str]) -> None:
        if desc.get("host") != os.uname().nodename:
            raise ValueError(f"rank {self.rank}: peer rank {peer} runs on host "
                             f"{desc.get('host')!r}, this rank on {os.uname().nodename!r}; "
                             "shared-memory notifications (cuda_ipc) need one host")
        for rings in (self.out, self.inbox):
            old = rings.pop(peer, None)
            if old is not None:
                old.close()
        t = desc["token"]
        self.ids[peer] = self.peer_id(peer)
        self.out[peer] = _Ring(self._path(self.rank, self.token, peer, t))
        self.inbox[peer] = _Ring(self._path(peer, t, self.rank, self.token))

    def notify(self, peer: int, msg: bytes) -> None:
        ring = self._write(peer, msg, staged=False)
        ring.head.value = ring.sent  # publish after the message (x86-64 keeps stores in order)

    def stage(self, peer: int, msg: bytes) -> int:
        """Write `msg` into `peer`'s ring without publishing it; the value whose write into
        the ring's head (offset 0 of `ring_memory`) publishes it and every message staged
        before it."""
        return self._write(peer, msg, staged=True).sent

    def publish(self, peer: int, value: int) -> None:
        """Publish the staged messages to `peer` up to `value` (`stage`'s) from the host."""
        self.out[peer].head.value = value

    def ring_memory(self, peer: int) -> tuple[int, int]:
        """(address, bytes) of the mapping of the ring this rank writes to `peer`."""
        return self.out[peer].address, _SIZE

    def on_close(self, peer: int, unpin: Callable[[], None]) -> None:
        """Call `unpin` before the ring to `peer` is unmapped (at close or re-import)."""
        self.out[peer].unpin = unpin

    def _write(self, peer: int, msg: bytes, staged: bool) -> _Ring:
        if len(msg) > PAYLOAD:
            raise ValueError(f"rank {self.rank}: a notification of {len(msg)} bytes; at most "
                             f"{PAYLOAD} fit a shared-memory slot")
        ring = self.out[peer]
        seq = ring.sent
        if not staged and ring.head.value != seq:
            self._wait(lambda: ring.head.value == seq,
                       f"the notifications staged for peer rank {peer} were not published "
                       "(the copies they follow have not landed)")
        if seq - ring.tail.value >= SLOTS:  # full: the peer has not read for a while
            self._wait(lambda: seq - ring.tail.value < SLOTS,
                       f"peer rank {peer} left {SLOTS} notifications unread")
        at = 64 + (seq % SLOTS) * _SLOT
        _LEN.pack_into(ring.map, at, len(msg))
        ring.map[at + 8:at + 8 + len(msg)] = msg
        ring.sent = seq + 1
        return ring

    def _wait(self, until: Callable[[], bool], why: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not until():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: {why} for {self.timeout_s:g} s")
            time.sleep(1e-5)

    def peer_id(self, peer: int) -> str:
        return f"shm:{peer}"  # the ring only that peer's process (its token) writes

    def poll(self) -> list[tuple[str, bytes]]:
        msgs = []
        for peer, ring in self.inbox.items():
            head, seq = ring.head.value, ring.tail.value
            if seq == head:
                continue
            while seq < head:
                at = 64 + (seq % SLOTS) * _SLOT
                n = _LEN.unpack_from(ring.map, at)[0]
                msgs.append((self.ids[peer], ring.map[at + 8:at + 8 + min(n, PAYLOAD)]))
                seq += 1
            ring.tail.value = seq
        return msgs

    def close(self) -> None:
        for ring in [*self.out.values(), *self.inbox.values()]:
            ring.close()
        self.out.clear()
        self.inbox.clear()
