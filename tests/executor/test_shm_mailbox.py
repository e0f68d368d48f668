"""Shared-memory notifications (`cuda_ipc`'s mailbox) between two real processes: every
message arrives once, in order, across ring wrap-arounds and a full ring (the sender waits
for the reader); both directions at once; files are gone after close; a peer on another
host is refused by name; a staged message is seen only once its head is written (what the
GPU does for `cuda_ipc`'s DONE)."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os

import pytest

from executor.transports.shm_mailbox import DIR, SLOTS, ShmMailbox

N = 3 * SLOTS + 17  # more than the ring holds: it wraps and fills up


def _peer(desc: dict, conn) -> None:
    box = ShmMailbox(1, "t")
    conn.send(box.export())
    box.import_peer(0, desc)
    for i in range(N):
        box.notify(0, b"m%06d" % i)
    got: list[bytes] = []
    while len(got) < 5:
        got += [m for _, m in box.poll()]
    conn.send(got)
    conn.recv()  # parent done reading
    box.close()


@pytest.mark.skipif(not os.path.isdir(DIR), reason="no /dev/shm")
def test_messages_arrive_once_in_order_across_processes():
    box = ShmMailbox(0, "t")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(box.export(), there))
    proc.start()
    try:
        box.import_peer(1, here.recv())
        for i in range(5):
            box.notify(1, b"back%d" % i)
        got: list[bytes] = []
        senders: set[str] = set()
        while len(got) < N:
            polled = box.poll()
            got += [m for _, m in polled]
            senders |= {s for s, _ in polled}
        assert got == [b"m%06d" % i for i in range(N)] and senders == {box.peer_id(1)}
        assert here.recv() == [b"back%d" % i for i in range(5)]
        assert box.poll() == []
        here.send("done")
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        box.close()
    assert not [f for f in os.listdir(DIR) if f.startswith("rplan-t-") and box.token in f]


def test_a_peer_on_another_host_is_refused():
    box = ShmMailbox(0, "t")
    with pytest.raises(ValueError, match="peer rank 3 runs on host 'elsewhere'"):
        box.import_peer(3, {"token": "ab", "host": "elsewhere"})
    with pytest.raises(ValueError, match="at most 120"):
        box.import_peer(4, box.export())
        box.notify(4, b"x" * 121)
    box.close()


def test_a_staged_message_waits_for_whoever_publishes_it():
    # what cuda_ipc's GPU does with a stream write into the head, here a plain store
    a, b = ShmMailbox(0, "s", timeout_s=0.05), ShmMailbox(1, "s")
    a.import_peer(1, b.export())
    b.import_peer(0, a.export())
    unpinned: list[int] = []
    try:
        address, nbytes = a.ring_memory(1)
        assert nbytes % mmap.PAGESIZE == 0 and address % mmap.PAGESIZE == 0  # pinnable
        a.on_close(1, lambda: unpinned.append(1))
        a.notify(1, b"first")
        assert a.stage(1, b"done-0") == 2 and a.stage(1, b"done-1") == 3
        assert [m for _, m in b.poll()] == [b"first"]  # staged ones are not visible yet
        with pytest.raises(TimeoutError, match="staged for peer rank 1 were not published"):
            a.notify(1, b"too early")  # one writer per ring: it would overwrite their slots
        head = ctypes.c_uint64.from_address(address)
        head.value = 2
        assert [m for _, m in b.poll()] == [b"done-0"]
        head.value = 3
        a.notify(1, b"after")
        assert [m for _, m in b.poll()] == [b"done-1", b"after"]
    finally:
        a.close()
        b.close()
    assert unpinned == [1]  # before the ring was unmapped
