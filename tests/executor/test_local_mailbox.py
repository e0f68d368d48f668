"""The `local` transport's signalling: a message is delivered exactly once
whatever the interleaving of its sender and the receiver's `poll`.

The regression test preempts the receiver's `poll` at every bytecode boundary in turn
(opcode tracing of the transport's Python frames): at that point a second sender, in
another thread or in another process, sends a message, and the receiver waits up to
50 ms for it (a sender blocked by the mailbox's lock finishes after `poll` returns). A
thread switch under the GIL happens only at such boundaries, so this covers every
interleaving of one message with one poll. Before the fix, `poll` copied the mailbox and
then cleared it: the message sent between the two was lost (this test failed there at
the boundary between the copy and the clear)."""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import sys
import threading
import time
from collections.abc import Callable

import pytest

from executor.transports import local as local_module
from executor.transports.local import Fabric, LocalTransport

TRANSPORT_DIR = os.path.dirname(local_module.__file__)


def _traced_poll(poll: Callable[[], list], at: int, preempt: Callable[[], None]
                 ) -> tuple[list, int]:
    """`poll()`, with `preempt()` run at its `at`-th bytecode boundary (counted over the
    transport package's frames it enters); the result and the number of boundaries."""
    count = 0

    def per_opcode(frame, event, arg):
        nonlocal count
        if event == "opcode":
            if count == at:
                preempt()
            count += 1
        return per_opcode

    def on_call(frame, event, arg):
        if frame.f_code.co_filename.startswith(TRANSPORT_DIR):
            frame.f_trace_opcodes = True
            return per_opcode
        return None

    sys.settrace(on_call)
    try:
        got = poll()
    finally:
        sys.settrace(None)
    return got, count


MSG = b"during the poll"


class _Sender:
    """Rank 2, in another thread or in a process forked once: sends `MSG` to rank 0 on
    `go`, while the traced poll waits (up to 50 ms; the sender may block on the mailbox's
    lock until poll releases it, then `wait` sees it finish)."""

    def __init__(self, tx: LocalTransport, process: bool) -> None:
        self.go_r, self.go_w = os.pipe()
        self.ack_r, self.ack_w = os.pipe()
        self.pid, self.sent = 0, False
        if not process:
            threading.Thread(target=self._serve, args=(tx,), daemon=True).start()
        elif (pid := os.fork()) == 0:
            code = 1
            try:
                self._serve(tx)
                code = 0
            finally:
                os._exit(code)
        else:
            self.pid = pid

    def _serve(self, tx: LocalTransport) -> None:
        while os.read(self.go_r, 1) == b"g":
            tx.notify(0, MSG)
            os.write(self.ack_w, b"a")

    def go(self) -> None:
        os.write(self.go_w, b"g")
        self.sent = bool(select.select([self.ack_r], [], [], 0.05)[0])
        if self.sent:
            os.read(self.ack_r, 1)

    def wait(self) -> None:
        if not self.sent:
            assert select.select([self.ack_r], [], [], 10)[0], "the sender never finished"
            os.read(self.ack_r, 1)

    def stop(self) -> None:
        os.write(self.go_w, b"q")
        if self.pid:
            assert os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1]) == 0


@pytest.mark.parametrize("senders", ["threads", "processes"])
def test_a_message_sent_at_any_point_of_a_poll_arrives_exactly_once(senders):
    process = senders == "processes"
    fabric = Fabric(shared=True) if process else Fabric()  # (main had no `shared`)
    rx, tx1, tx2 = (LocalTransport(r, "t", fabric) for r in range(3))
    rx.register([])
    for tx in (tx1, tx2):
        tx.import_peer(0, rx.export())
    sender = _Sender(tx2, process)
    at, boundaries = 0, 1
    try:
        while at < boundaries:
            tx1.notify(0, b"before the poll")
            got, boundaries = _traced_poll(rx.poll, at, sender.go)
            sender.wait()
            got += rx.poll()
            assert sorted(got) == [("local:1", b"before the poll"), ("local:2", MSG)], (
                f"preempted at bytecode {at} of {boundaries} in poll: got {got}")
            at += 1
    finally:
        sender.stop()
    assert at >= 5  # poll's frames were traced (not a vacuous loop)


def _put_many(box, sender: int, n: int) -> None:
    for i in range(n):
        box.put(sender, b"%d:%06d" % (sender, i))
    os._exit(0)


def test_a_shared_mailbox_takes_every_message_once_in_order_from_many_processes():
    from executor.transports.local_mailbox import SharedMailbox

    # 4 forked senders put 3000 messages each into a 64-slot ring (it fills up and wraps
    # hundreds of times: senders wait for the reader) while this process takes them.
    box, n = SharedMailbox(slots=64, timeout_s=60), 3000
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_put_many, args=(box, s, n)) for s in range(4)]
    for p in procs:
        p.start()
    got: dict[int, list[bytes]] = {s: [] for s in range(4)}
    deadline = time.monotonic() + 120
    while sum(map(len, got.values())) < 4 * n and time.monotonic() < deadline:
        for sender, msg in box.take():
            got[sender].append(msg)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    for s in range(4):
        assert got[s] == [b"%d:%06d" % (s, i) for i in range(n)], s
    assert box.take() == []


def test_a_shared_mailbox_refuses_an_oversized_message_by_name():
    from executor.transports.local_mailbox import SharedMailbox

    with pytest.raises(ValueError, match="121 bytes from rank 3; at most 120"):
        SharedMailbox(slots=4).put(3, b"x" * 121)


def test_a_full_shared_mailbox_times_out_naming_the_sender():
    from executor.transports.local_mailbox import SharedMailbox

    box = SharedMailbox(slots=2, timeout_s=0.2)
    box.put(1, b"a")
    box.put(1, b"b")
    with pytest.raises(TimeoutError, match="rank 1's message found the receiver's 2"):
        box.put(1, b"c")
    assert box.take() == [(1, b"a"), (1, b"b")]


def test_a_shared_fabric_refuses_gpu_regions_by_name():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    tx = LocalTransport(0, "t", Fabric(shared=True))
    with pytest.raises(ValueError, match="needs CPU tensors"):
        tx.register([torch.zeros(8, dtype=torch.uint8, device="cuda")])
