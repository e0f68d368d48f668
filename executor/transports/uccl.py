"""UCCL P2P transport (RDMA verbs / EFA): the production path. Optional: `import uccl`.

Written against UCCL's documented `p2p.Endpoint` API (p2p/README.md, tests/
test_engine_write.py): `reg`, `get_metadata`/`parse_metadata`, `connect`/`accept`,
`advertisev` (the receiver exposes exact byte ranges as 64-byte FIFO blobs), `writev`.

Connections, once, at `import_peer`: every pair (a < b) connects both ways in the same
global order on both ranks (a connects, b accepts; then b connects, a accepts), and a
connector waits for the acceptor's `turn` key so that `accept()` cannot pick another
rank's connection. Write ranges: a writer publishes each batch's dst ranges in the store
at `prepare`; the target advertises them on the writer's connection when it next polls
and publishes the blobs; the writer picks them up at its first post and keeps them for
every later step. Notifications go through the store (`StoreMailbox`).
Untested here (no RDMA NIC on CI); see the executor report for what a GPU test must do.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import torch

from .base import Capabilities, Store, StoreMailbox, WriteBatch

_TURN_TIMEOUT_S = 300.0


class _Batch:
    __slots__ = ("peer", "key", "mr_ids", "srcs", "sizes", "blobs", "pending")

    def __init__(self, peer: int, key: str, mr_ids: list[int], srcs: list[int],
                 sizes: list[int]) -> None:
        self.peer, self.key, self.mr_ids, self.srcs, self.sizes = peer, key, mr_ids, srcs, sizes
        self.blobs: list[bytes] | None = None
        self.pending = False


class UcclTransport:
    capabilities = Capabilities()
    """None: a post does not wait for the caller's stream (the executor syncs before it)."""

    def __init__(self, rank: int, namespace: str, store: Store, device: torch.device,
                 num_cpus: int = 4) -> None:
        from uccl import p2p

        self.p2p, self.rank, self.ns, self.store = p2p, rank, f"{namespace}/uccl", store
        self.ep = p2p.Endpoint(max(device.index or 0, 0), num_cpus)
        self.mailbox = StoreMailbox(rank, namespace, store)
        self.out_conn: dict[int, int] = {}
        self.in_conn: dict[int, int] = {}
        self.served: dict[int, int] = {}
        self.requested: dict[int, int] = {}

    def register(self, regions: list[torch.Tensor]) -> None:
        self.regions, self.mr = regions, []
        for i, r in enumerate(regions):
            ok, mr_id = self.ep.reg(r.data_ptr(), r.numel()) if r.numel() else (True, -1)
            if not ok:
                raise RuntimeError(f"rank {self.rank}: UCCL could not register region {i}")
            self.mr.append(mr_id)

    def export(self) -> dict[str, Any]:
        return {"md": bytes(self.ep.get_metadata())}

    def import_peer(self, peer: int, desc: dict[str, Any]) -> None:
        first, second = (self._connect, self._accept) if self.rank < peer else \
            (self._accept, self._connect)
        first(peer, desc["md"])
        second(peer, desc["md"])
        self.mailbox.listen(peer)

    def _connect(self, peer: int, md: bytes) -> None:
        deadline = time.monotonic() + _TURN_TIMEOUT_S
        while self.store.get(f"{self.ns}/turn/{peer}") != str(self.rank).encode():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: UCCL peer rank {peer} never accepted")
            time.sleep(0.001)
        ip, port, gpu = self.p2p.Endpoint.parse_metadata(md)
        ok, conn = self.ep.connect(ip, gpu, remote_port=port)
        if not ok:
            raise RuntimeError(f"rank {self.rank}: UCCL could not connect to rank {peer} at "
                               f"{ip}:{port}")
        self.out_conn[peer] = conn

    def _accept(self, peer: int, md: bytes) -> None:
        self.store.set(f"{self.ns}/turn/{self.rank}", str(peer).encode())
        ok, _, _, conn = self.ep.accept()
        if not ok:
            raise RuntimeError(f"rank {self.rank}: UCCL accept from rank {peer} failed")
        self.in_conn[peer] = conn
        self.served[peer] = 0

    def prepare(self, batch: WriteBatch) -> _Batch:
        keep = batch.nbytes > 0
        k = self.requested.get(batch.peer, 0)
        self.requested[batch.peer] = k + 1
        key = f"{self.ns}/req/{batch.peer}/{self.rank}"
        self.store.set(f"{key}/{k}", msgpack.packb([batch.dst_region[keep].tolist(),
                                                    batch.dst_offset[keep].tolist(),
                                                    batch.nbytes[keep].tolist()]))
        self.store.set(f"{key}/count", str(k + 1).encode())
        base = [r.data_ptr() for r in self.regions]
        srcs = [base[r] + o for r, o in zip(batch.src_region[keep].tolist(),
                                            batch.src_offset[keep].tolist())]
        mr_ids = [self.mr[r] for r in batch.src_region[keep].tolist()]
        return _Batch(batch.peer, f"{key}/{k}", mr_ids, srcs, batch.nbytes[keep].tolist())

    def _serve(self) -> None:
        """Advertise the ranges writers asked for since the last poll (target side)."""
        for peer, done in self.served.items():
            count = self.store.get(f"{self.ns}/req/{self.rank}/{peer}/count")
            for k in range(done, int(count) if count else 0):
                raw = self.store.get(f"{self.ns}/req/{self.rank}/{peer}/{k}")
                regions, offsets, sizes = msgpack.unpackb(raw)
                addrs = [self.regions[r].data_ptr() + o for r, o in zip(regions, offsets)]
                ok, blobs = self.ep.advertisev(self.in_conn[peer], [self.mr[r] for r in regions],
                                               addrs, sizes, len(sizes))
                if not ok:
                    raise RuntimeError(f"rank {self.rank}: UCCL advertise for rank {peer} failed")
                self.store.set(f"{self.ns}/req/{self.rank}/{peer}/{k}/blobs",
                               msgpack.packb([bytes(b) for b in blobs]))
                self.served[peer] = k + 1

    def post(self, handle: _Batch) -> None:
        handle.pending = bool(handle.sizes)
        self._try(handle)

    def done(self, handle: _Batch) -> bool:
        if handle.pending:
            self._try(handle)
        return not handle.pending

    def _try(self, handle: _Batch) -> None:
        """Write the batch (blocking `writev`) once its blobs are known."""
        if not handle.pending:
            return
        if handle.blobs is None:
            raw = self.store.get(f"{handle.key}/blobs")
            if raw is None:
                self._serve()  # two ranks may write to each other
                return
            handle.blobs = msgpack.unpackb(raw)
        ok = self.ep.writev(self.out_conn[handle.peer], handle.mr_ids, handle.srcs,
                            handle.sizes, handle.blobs, len(handle.sizes))
        if not ok:
            raise RuntimeError(f"rank {self.rank}: UCCL writev to rank {handle.peer} failed")
        handle.pending = False

    def notify(self, peer: int, msg: bytes) -> None:
        self.mailbox.notify(peer, msg)

    def notify_landed(self, handles: list[Any], peer: int, msg: bytes) -> bool:
        return False  # no device-side notification: the executor sends it from the host

    def peer_id(self, peer: int) -> str:
        return self.mailbox.peer_id(peer)

    def release(self, handle: Any) -> None:
        pass  # a prepared batch holds no transport resources of its own

    def stats(self) -> dict[str, int]:
        return {}

    def poll(self) -> list[tuple[str, bytes]]:
        self._serve()
        return self.mailbox.poll()

    def close(self) -> None:
        pass
