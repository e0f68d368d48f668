"""In-process transport: every rank lives in this process and shares one `Fabric`.

Writes are torch copies between the ranks' regions, prepared once per batch
(`torch_copy.py`); on a GPU, one launch of the batched copy kernel (`copy_kernel.py`)
where it builds. Every rank queues its kernels and copies on the one current stream, in
program order: on a GPU a batch's copies are one CUDA graph, a stage's batches one batch
per destination, and nothing waits for a kernel before a signal (`one_stream`).

Signals go through the receiving rank's mailbox (`local_mailbox.py`: exactly once under any
interleaving). `Fabric(shared=True)` lets the ranks run as processes: build, register and
connect every rank in one process, then fork one process per rank; regions move to shared
memory at `register` and the mailboxes live in shared memory (CPU tensors only; the store
stays per process after the fork, so a failed step is not recovered across processes).
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from typing import Any

import torch

from ..gpu.copy_kernel import CopyKernel
from ..gpu.graphs import as_graph
from .base import Capabilities, WriteBatch, batch_copies
from .local_mailbox import Mailbox, SharedMailbox
from .options import LocalOptions
from .torch_copy import Op, prepare_copies


class Fabric:
    """The shared registry of an in-process world: regions, mailboxes and a key/value store.
    `shared`: ranks may be forked into processes after `connect` (see the module doc)."""

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self.regions: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.mailboxes: dict[tuple[str, int], Mailbox | SharedMailbox] = {}
        self.kv: dict[str, bytes] = {}
        self.secret = os.urandom(32)
        """The job secret of this in-process world (it never leaves the process)."""
        self.children: dict[int, Fabric] = {}
        """`child(key)`'s fabrics, kept with this one."""
        self._lock = threading.Lock()

    def mailbox(self, namespace: str, rank: int) -> Mailbox | SharedMailbox:
        """Rank `rank`'s mailbox, made on first use (by its sender or by itself)."""
        with self._lock:
            box = self.mailboxes.get((namespace, rank))
            if box is None:
                box = SharedMailbox() if self.shared else Mailbox()
                self.mailboxes[(namespace, rank)] = box
            return box

    def child(self, key: int) -> Fabric:
        """A fabric of its own for `key` (a chunked shadow's chunk k), made on first use with
        this one's `shared` and job secret: its ranks meet only each other's."""
        with self._lock:
            kid = self.children.get(key)
            if kid is None:
                kid = self.children[key] = Fabric(shared=self.shared)
                kid.secret = self.secret
            return kid

    def set(self, key: str, value: bytes) -> None:
        self.kv[key] = value

    def get(self, key: str) -> bytes | None:
        return self.kv.get(key)


FABRIC = Fabric()
"""The default fabric of this process."""


class LocalTransport:
    capabilities = Capabilities(ordered_posts=True, one_stream=True)
    """Copies run on the caller's current stream, in the order they are posted; on a GPU
    (known at `register`) also `graph_ops` and `fuse_batches` (see the module doc)."""

    def __init__(self, rank: int, namespace: str, fabric: Fabric | None = None,
                 options: LocalOptions | None = None) -> None:
        self.rank, self.ns, self.fabric = rank, namespace, fabric or FABRIC
        self.options = options or LocalOptions()
        self.peers: dict[int, list[torch.Tensor]] = {}
        self.regions: list[torch.Tensor] = []
        self.inbox = self.fabric.mailbox(namespace, rank)
        self.outboxes: dict[int, Mailbox | SharedMailbox] = {}

    def register(self, regions: list[torch.Tensor]) -> None:
        if self.fabric.shared:  # peers forked later write into them
            for r in regions:
                if r.is_cuda:
                    raise ValueError(f"rank {self.rank}: a shared Fabric (ranks forked into "
                                     f"processes) needs CPU tensors, not {r.device}; use "
                                     "'cuda_ipc' or 'nixl' for GPU ranks in processes")
                r.share_memory_()
        self.regions = regions
        self.fabric.regions[(self.ns, self.rank)] = regions
        gpu = bool(regions) and regions[0].is_cuda
        self.capabilities = replace(type(self).capabilities, graph_ops=gpu, fuse_batches=gpu)

    def export(self) -> dict[str, Any]:
        return {"rank": self.rank}

    def import_peer(self, peer: int, desc: dict[str, Any]) -> None:
        self.peers[peer] = self.fabric.regions[(self.ns, int(desc["rank"]))]
        self.outboxes[peer] = self.fabric.mailbox(self.ns, int(desc["rank"]))

    def prepare(self, batch: WriteBatch) -> list[Op]:
        gpu = self.capabilities.graph_ops
        ops = self._kernel_ops(batch) if gpu else None
        if ops is None:
            ops = prepare_copies(self.regions, self.peers[batch.peer], batch)
        if gpu:
            ops = as_graph(ops, self.regions[0].device, f"rank {self.rank} writes")
        return ops

    def _kernel_ops(self, batch: WriteBatch) -> list[Op] | None:
        """The batch as one launch of the copy kernel, or None (turned off, or the peer's
        regions on another device, or no kernel on this device)."""
        dev = self.regions[0].device
        peer = self.peers[batch.peer]
        if not self.options.copy_kernel or any(r.device != dev for r in peer):
            return None
        kernel = CopyKernel.load(dev)
        if kernel is None:
            return None
        table = kernel.table(*batch_copies(self.regions, peer, batch))
        return [lambda: kernel.launch(table)]

    def post(self, handle: list[Op]) -> None:
        for op in handle:
            op()

    def done(self, handle: list[Op]) -> bool:
        return True

    def notify(self, peer: int, msg: bytes) -> None:
        box = self.outboxes.get(peer)
        (self.fabric.mailbox(self.ns, peer) if box is None else box).put(self.rank, msg)

    def notify_landed(self, handles: list[Any], peer: int, msg: bytes) -> bool:
        return False  # no device-side notification: the executor sends it from the host

    def peer_id(self, peer: int) -> str:
        return f"local:{peer}"

    def release(self, handle: list[Op]) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}

    def poll(self) -> list[tuple[str, bytes]]:
        return [(f"local:{sender}", msg) for sender, msg in self.inbox.take()]

    def close(self) -> None:
        self.fabric.regions.pop((self.ns, self.rank), None)
