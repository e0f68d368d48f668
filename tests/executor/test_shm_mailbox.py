"""Shared-memory notifications (`cuda_ipc`'s mailbox) between two real processes: every
message arrives once, in order, across ring wrap-arounds and a full ring (the sender waits
for the reader); both directions at once; files are gone after close; a peer on another
host is refused by name."""

from __future__ import annotations

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
