"""In-process transport: every rank lives in this process and shares one `Fabric`.

Writes are torch copies between the ranks' regions, prepared once per batch
(`torch_copy.py`); on a GPU, one launch of the batched copy kernel (`copy_kernel.py`)
where it builds. Every rank queues its kernels and copies on the one current stream, in
program order: on a GPU a batch's copies are one CUDA graph, a stage's batches one batch
per destination, and nothing waits for a kernel before a signal (`one_stream`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import torch

from .base import WriteBatch
from .copy_kernel import CopyKernel, batch_copies
from .graphs import as_graph
from .options import LocalOptions
from .torch_copy import Op, prepare_copies


class Fabric:
    """The shared registry of an in-process world: regions, mailboxes and a key/value store."""

    def __init__(self) -> None:
        self.regions: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.mailboxes: dict[tuple[str, int], list[tuple[str, bytes]]] = defaultdict(list)
        self.kv: dict[str, bytes] = {}
        self.secret = os.urandom(32)
        """The job secret of this in-process world (it never leaves the process)."""

    def set(self, key: str, value: bytes) -> None:
        self.kv[key] = value

    def get(self, key: str) -> bytes | None:
        return self.kv.get(key)


FABRIC = Fabric()
"""The default fabric of this process."""


class LocalTransport:
    ordered_posts = one_stream = True
    """Copies run on the caller's current stream, in the order they are posted."""

    def __init__(self, rank: int, namespace: str, fabric: Fabric | None = None,
                 options: LocalOptions | None = None) -> None:
        self.rank, self.ns, self.fabric = rank, namespace, fabric or FABRIC
        self.options = options or LocalOptions()
        self.peers: dict[int, list[torch.Tensor]] = {}
        self.regions: list[torch.Tensor] = []
        self.fuse_batches = self.graph_ops = False  # on a GPU: see the module doc

    def register(self, regions: list[torch.Tensor]) -> None:
        self.regions = regions
        self.fabric.regions[(self.ns, self.rank)] = regions
        self.fuse_batches = self.graph_ops = bool(regions) and regions[0].is_cuda

    def export(self) -> dict[str, Any]:
        return {"rank": self.rank}

    def import_peer(self, peer: int, desc: dict[str, Any]) -> None:
        self.peers[peer] = self.fabric.regions[(self.ns, int(desc["rank"]))]

    def prepare(self, batch: WriteBatch) -> list[Op]:
        ops = self._kernel_ops(batch) if self.graph_ops else None
        if ops is None:
            ops = prepare_copies(self.regions, self.peers[batch.peer], batch)
        if self.graph_ops:
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
        self.fabric.mailboxes[(self.ns, peer)].append((f"local:{self.rank}", msg))

    def peer_id(self, peer: int) -> str:
        return f"local:{peer}"

    def release(self, handle: list[Op]) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}

    def poll(self) -> list[tuple[str, bytes]]:
        box = self.fabric.mailboxes[(self.ns, self.rank)]
        msgs, box[:] = list(box), []
        return msgs

    def close(self) -> None:
        self.fabric.regions.pop((self.ns, self.rank), None)
