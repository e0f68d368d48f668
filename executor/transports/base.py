"""The one narrow interface every transport implements, and the rendezvous store it may use.

A transport moves bytes between ranks' registered regions with one-sided writes. It never
sees a plan: the executor hands it flat uint8 regions once, descriptors of peers once, and
batches of writes (one peer each) once; per step it only posts prepared batches, polls
them, and sends/receives short notification messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..gpu.copy_kernel import coalesce
from .ipc_regions import check_cuda_desc


@dataclass(frozen=True, slots=True)
class WriteBatch:
    """Writes of one batch to one peer: `nbytes[i]` bytes from local `src_region[i]` at
    `src_offset[i]` to the peer's `dst_region[i]` at `dst_offset[i]` (numpy int64 arrays)."""

    peer: int
    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray
    beside_packs: bool = False
    """Posted while the rank's next pack group runs on its SMs (`executor/pipeline.py`): a
    transport that can copy on the SMs or on the copy engines may leave the SMs to it."""


@dataclass(slots=True)
class Prepared:
    """A batch prepared once at connect: the transport's handle (replaced when the peer is
    re-imported or the batch is prepared again), its peer and its writes."""

    handle: Any
    peer: int
    batch: WriteBatch


class Store(Protocol):
    """Key/value rendezvous shared by all ranks (an in-process dict or a TCPStore)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None:
        """The value, or None if no rank has set `key` yet (never blocks)."""
        ...


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport promises beyond the calls of `Transport`; the executor reads these
    and nothing else about it. The defaults are the conservative behaviour: a transport that
    declares nothing gets host waits before its posts and one batch per plan batch."""

    ordered_posts: bool = False
    """A posted batch runs after the kernels queued before it on the caller's current stream:
    the executor posts a stage's writes right after its packs, without waiting for them on
    the host."""
    one_stream: bool = False
    """Every rank's kernels and copies queue on one stream of one process, in program order
    (`local`): nothing waits for a kernel before a signal."""
    graph_ops: bool = False
    """The executor captures a stage's packs and unpacks as one CUDA graph each."""
    fuse_batches: bool = False
    """A stage's batches become one batch per destination peer (one post each)."""
    notify_landed: bool = False
    """The transport has `notify_landed(handles, peer, msg) -> bool`: it sends `msg` to
    `peer` from the device once the posted batches `handles` have landed, or returns False
    (then the executor sends it from the host once `done` says they landed)."""


class Transport(Protocol):
    capabilities: Capabilities
    """What it promises beyond these calls (may change at `register`, never after)."""

    def register(self, regions: list[torch.Tensor]) -> None:
        """Register this rank's flat uint8 regions (once, before `export`)."""
        ...

    def export(self) -> dict[str, Any]:
        """msgpack-able descriptors a peer needs to write into this rank and notify it."""
        ...

    def import_peer(self, peer: int, desc: dict[str, Any]) -> None:
        """Make `peer` (its `export()`) writable and notifiable."""
        ...

    def prepare(self, batch: WriteBatch) -> Any:
        """A handle that `post` can replay every step (descriptor lists built here, once)."""
        ...

    def post(self, handle: Any) -> None:
        """Start the writes of a prepared batch."""
        ...

    def done(self, handle: Any) -> bool:
        """Whether a posted batch has landed at the peer; raises on a transport error."""
        ...

    def notify(self, peer: int, msg: bytes) -> None:
        """Send a short message to `peer`, ordered after writes already completed."""
        ...

    def notify_landed(self, handles: list[Any], peer: int, msg: bytes) -> bool:
        """Send `msg` to `peer` from the device once the posted batches `handles` have
        landed; False where it cannot (then the executor sends it from the host once `done`
        says they landed). Called only where `capabilities.notify_landed` says so."""
        ...

    def poll(self) -> list[tuple[str, bytes]]:
        """(sender, message) pairs that arrived since the last poll (never blocks). `sender`
        is the transport-level identity of the process that sent it (e.g. its NIXL agent
        name), as `peer_id` names an imported peer; "" where the transport cannot tell."""
        ...

    def peer_id(self, peer: int) -> str:
        """The transport-level identity of the imported `peer` ("" if it has none)."""
        ...

    def release(self, handle: Any) -> None:
        """Free a prepared batch (its peer restarted, or it failed in flight)."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for benchmarks and tests (e.g. device copies, handles leaked)."""
        ...

    def close(self) -> None: ...


class StoreMailbox:
    """Notifications through a `Store`: message `seq` from `src` to `dst` is the key
    `<ns>/msg/<dst>/<src>/<seq>` (for transports without their own notifications)."""

    def __init__(self, rank: int, namespace: str, store: Store) -> None:
        self.rank, self.ns, self.store = rank, namespace, store
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}

    def peer_id(self, peer: int) -> str:
        return f"store:{peer}"  # the key it wrote (anyone may write keys: MACs decide)

    def listen(self, peer: int) -> None:
        self.received.setdefault(peer, 0)

    def notify(self, peer: int, msg: bytes) -> None:
        seq = self.sent.get(peer, 0)
        self.store.set(f"{self.ns}/msg/{peer}/{self.rank}/{seq}", msg)
        self.sent[peer] = seq + 1

    def poll(self) -> list[tuple[str, bytes]]:
        msgs = []
        for peer, seq in self.received.items():
            while (m := self.store.get(f"{self.ns}/msg/{self.rank}/{peer}/{seq}")) is not None:
                msgs.append((self.peer_id(peer), m))
                seq += 1
            self.received[peer] = seq
        return msgs


def check_peer_desc(transport: Any, peer: int, desc: Any,
                    peer_regions: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]) -> None:
    """`peer`'s descriptor against the plan's (region, bytes) of that peer (`peer_regions`:
    the rank plan's), before `import_peer` uses anything of it, where the transport maps the
    peer's memory from handles that state sizes and offsets (`cuda_ipc`:
    `ipc_regions.check_cuda_desc`): a ValueError of one line naming the peer otherwise."""
    if type(transport).__module__ == f"{__package__}.cuda_ipc":
        check_cuda_desc(peer, desc, dict(peer_regions).get(peer, ()))


def batch_copies(src_regions: list[torch.Tensor], dst_regions: list[torch.Tensor],
                 batch: WriteBatch, src_alloc: np.ndarray | None = None,
                 dst_alloc: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's non-empty writes as raw (dst, src, nbytes) int64 arrays, merged where
    adjacent on both sides (`coalesce`); `*_alloc`: each region's allocation base, for the
    copy engines (a copy must stay inside one), None for the kernel (it may span them)."""
    keep = batch.nbytes > 0
    sr, dr = batch.src_region[keep], batch.dst_region[keep]
    src = np.array([r.data_ptr() for r in src_regions], dtype=np.int64)
    dst = np.array([r.data_ptr() for r in dst_regions], dtype=np.int64)
    none = np.zeros(len(sr), dtype=np.int64)
    return coalesce(dst[dr] + batch.dst_offset[keep], src[sr] + batch.src_offset[keep],
                    batch.nbytes[keep].astype(np.int64),
                    none if dst_alloc is None else dst_alloc[dr],
                    none if src_alloc is None else src_alloc[sr])
