"""In-process transport: every rank lives in this process and shares one `Fabric`.

Writes are torch copies between the ranks' regions, prepared once per batch: writes of
one (src region, dst region, size) group become one `index_select` + `index_copy_` over
byte-row views (`as_strided(region, (N, nbytes), (1, 1))`), large writes a slice copy each.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .base import WriteBatch

_BIG = 1 << 16  # writes of at least this many bytes are copied one slice each


class Fabric:
    """The shared registry of an in-process world: regions, mailboxes and a key/value store."""

    def __init__(self) -> None:
        self.regions: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.mailboxes: dict[tuple[str, int], list[bytes]] = defaultdict(list)
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.kv[key] = value

    def get(self, key: str) -> bytes | None:
        return self.kv.get(key)


FABRIC = Fabric()
"""The default fabric of this process."""


def _slice_copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    if dst.is_cpu and src.is_cpu:  # a plain memcpy: torch's thread pool costs more than it
        d, s = dst.numpy(), src.numpy()  # gains per slice on a busy CPU

        def op() -> None:
            np.copyto(d, s)
        return op

    def op() -> None:
        dst.copy_(src)
    return op


def _row_copy(dst: torch.Tensor, src: torch.Tensor, do: np.ndarray, so: np.ndarray,
              n: int) -> Callable[[], None]:
    s2 = src.as_strided((int(so.max()) + 1, n), (1, 1))
    d2 = dst.as_strided((int(do.max()) + 1, n), (1, 1))
    si, di = torch.from_numpy(so.copy()).to(src.device), torch.from_numpy(do.copy()).to(dst.device)

    def op() -> None:
        d2.index_copy_(0, di, s2.index_select(0, si))
    return op


class LocalTransport:
    def __init__(self, rank: int, namespace: str, fabric: Fabric | None = None) -> None:
        self.rank, self.ns, self.fabric = rank, namespace, fabric or FABRIC
        self.peers: dict[int, list[torch.Tensor]] = {}

    def register(self, regions: list[torch.Tensor]) -> None:
        self.regions = regions
        self.fabric.regions[(self.ns, self.rank)] = regions

    def export(self) -> dict[str, Any]:
        return {"rank": self.rank}

    def import_peer(self, peer: int, desc: dict[str, Any]) -> None:
        self.peers[peer] = self.fabric.regions[(self.ns, int(desc["rank"]))]

    def prepare(self, batch: WriteBatch) -> list[Callable[[], None]]:
        dst_regions, ops = self.peers[batch.peer], []
        cols = np.stack([batch.src_region, batch.dst_region, batch.nbytes], axis=1)
        big = batch.nbytes >= _BIG
        for i in np.flatnonzero(big):
            so, do, n = int(batch.src_offset[i]), int(batch.dst_offset[i]), int(batch.nbytes[i])
            ops.append(_slice_copy(dst_regions[cols[i, 1]][do:do + n],
                                   self.regions[cols[i, 0]][so:so + n]))
        small = np.flatnonzero(~big & (batch.nbytes > 0))
        if len(small):
            keys, inverse = np.unique(cols[small], axis=0, return_inverse=True)
            for g, (sr, dr, n) in enumerate(keys.tolist()):
                rows = small[inverse.reshape(-1) == g]
                ops.append(_row_copy(dst_regions[dr], self.regions[sr],
                                     batch.dst_offset[rows], batch.src_offset[rows], n))
        return ops

    def post(self, handle: list[Callable[[], None]]) -> None:
        for op in handle:
            op()

    def done(self, handle: list[Callable[[], None]]) -> bool:
        return True

    def notify(self, peer: int, msg: bytes) -> None:
        self.fabric.mailboxes[(self.ns, peer)].append(msg)

    def poll(self) -> list[bytes]:
        box = self.fabric.mailboxes[(self.ns, self.rank)]
        msgs, box[:] = list(box), []
        return msgs

    def close(self) -> None:
        self.fabric.regions.pop((self.ns, self.rank), None)
