"""CUDA IPC transport: GPUs of one host, peer copies over NVLink/PCIe.

Each rank exports a CUDA IPC handle per region once (`UntypedStorage._share_cuda_()`);
its fields travel as msgpack (bytes and ints), never pickle. A peer opens them with
`UntypedStorage._new_shared_cuda(...)` and writes into them with copies prepared once
(`torch_copy.py`), replayed on a dedicated stream; a batch has landed when its CUDA event
has. Notifications go through the rendezvous store (`StoreMailbox`).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Store, StoreMailbox, WriteBatch
from .torch_copy import Op, prepare_copies


def _export_region(t: torch.Tensor) -> list[Any]:
    storage = t.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    return [int(device), bytes(handle), int(size), int(offset), bytes(ref_handle),
            int(ref_offset), bytes(event_handle or b""), bool(event_sync),
            int(t.storage_offset()), int(t.numel())]


def _import_region(fields: list[Any]) -> torch.Tensor:
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync, \
        storage_offset, numel = fields
    storage = torch.UntypedStorage._new_shared_cuda(
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync)
    t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    return t.set_(storage, storage_offset, (numel,), (1,))


class _Posted:
    __slots__ = ("ops", "event")

    def __init__(self, ops: list[Op]) -> None:
        self.ops, self.event = ops, None


class CudaIpcTransport:
    def __init__(self, rank: int, namespace: str, store: Store, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"rank {rank}: transport 'cuda_ipc' needs CUDA tensors, got "
                             f"{device}; use 'nixl' or 'local' for CPU tensors")
        self.rank, self.ns, self.store, self.device = rank, namespace, store, device
        self.stream = torch.cuda.Stream(device)
        self.peers: dict[int, list[torch.Tensor]] = {}
        self.mailbox = StoreMailbox(rank, namespace, store)

    def register(self, regions: list[torch.Tensor]) -> None:
        self.regions = regions

    def export(self) -> dict[str, Any]:
        return {"regions": [_export_region(r) for r in self.regions]}

    def import_peer(self, peer: int, desc: dict[str, Any]) -> None:
        self.peers[peer] = [_import_region(f) for f in desc["regions"]]
        self.mailbox.listen(peer)

    def prepare(self, batch: WriteBatch) -> _Posted:
        return _Posted(prepare_copies(self.regions, self.peers[batch.peer], batch))

    def post(self, handle: _Posted) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for op in handle.ops:
                op()
            handle.event = torch.cuda.Event()
            handle.event.record(self.stream)

    def done(self, handle: _Posted) -> bool:
        return handle.event is None or handle.event.query()

    def notify(self, peer: int, msg: bytes) -> None:
        self.mailbox.notify(peer, msg)

    def poll(self) -> list[bytes]:
        return self.mailbox.poll()

    def close(self) -> None:
        self.stream.synchronize()
        self.peers.clear()
