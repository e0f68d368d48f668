"""A stage's DONE published by the GPU, for `cuda_ipc`.

The message (MACed by the executor as any other) is staged in its slot of the peer's
shared-memory ring (`ShmMailbox.stage`); a `cuStreamWriteValue64` on a signal stream,
queued behind the batches' landed events, writes the ring's head (the ring's file pinned
and mapped for the GPU once, `Runtime.map_host`). The peer sees DONE when the copies have
landed, not after this host noticed them and wrote it; it checks the message like any
other: the GPU only moves the head.
"""

from __future__ import annotations

import warnings

import torch

from ..gpu.cuda_runtime import Runtime, StreamWrites
from .shm_mailbox import ShmMailbox


class DeviceSignals:
    def __init__(self, rank: int, device: torch.device, rt: Runtime, writes: StreamWrites,
                 mailbox: ShmMailbox) -> None:
        self.rank, self.device, self.rt, self.mailbox = rank, device, rt, mailbox
        self.writes: StreamWrites | None = writes
        """None once a call failed: every DONE goes from the host from then on."""
        self.stream = torch.cuda.Stream(device)
        self.ring_ptrs: dict[int, int] = {}  # peer -> its ring's head as the GPU addresses it
        self.sent = 0  # notifications the GPU published

    @staticmethod
    def load(rank: int, device: torch.device, rt: Runtime,
             mailbox: ShmMailbox) -> DeviceSignals | None:
        """None where the driver has no stream writes."""
        writes = StreamWrites.load()
        return None if writes is None else DeviceSignals(rank, device, rt, writes, mailbox)

    def after(self, events: list[int], peer: int, msg: bytes) -> bool:
        """Publish `msg` to `peer` once every CUDA event of `events` has completed; False
        where that cannot be done (nothing is staged then: the host sends it)."""
        rt, writes = self.rt, self.writes
        if writes is None:
            return False
        head = self._ring_ptr(peer)
        if head is None:
            return False
        stream = self.stream.cuda_stream
        bad = 0
        for event in events:
            bad = bad or rt.wait_event(stream, event, 0)
        if bad:
            rt.last_error()
            return False
        value = self.mailbox.stage(peer, msg)
        bad = writes.write64(stream, head, value)
        if bad:  # staged but not queued: publish it from the host once the copies landed
            warnings.warn(f"rank {self.rank}: cuStreamWriteValue64 failed (CUDA driver error "
                          f"{bad}); DONE goes from the host from now on", stacklevel=3)
            self.writes = None
            self.stream.synchronize()
            self.mailbox.publish(peer, value)
        else:
            self.sent += 1
        return True

    def _ring_ptr(self, peer: int) -> int | None:
        """The GPU's address of the head of this rank's ring to `peer`, pinned and mapped
        once (None where that fails: DONE then goes from the host)."""
        ptr = self.ring_ptrs.get(peer)
        if ptr is None:
            rt = self.rt
            address, nbytes = self.mailbox.ring_memory(peer)
            try:
                with torch.cuda.device(self.device):
                    ptr = rt.map_host(address, nbytes)
            except RuntimeError as e:
                warnings.warn(f"rank {self.rank}: could not map the notification ring to peer "
                              f"{peer} for the GPU ({e}); DONE goes from the host", stacklevel=4)
                self.writes = None
                return None
            self.mailbox.on_close(peer, lambda: rt.unmap_host(address))
            self.ring_ptrs[peer] = ptr
        return ptr

    def settle(self) -> None:
        """Wait for every queued stream write (before a ring may be unmapped)."""
        self.stream.synchronize()

    def forget(self, peer: int) -> None:
        """`peer`'s ring is about to be replaced (re-import): settle, drop its address."""
        self.settle()
        self.ring_ptrs.pop(peer, None)
