"""A chunked plan's sources and targets in one process (`World`), shared by the chunked
shadow's tests (tests/executor/test_chunked*.py)."""

from __future__ import annotations

import threading

import torch

from executor.chunked import ChunkedShadow, load_chunks
from executor.transports.local import Fabric
from harness.weights import materialize, random_full_tensors
from tests.support.shadow_plans import layouts

BUDGET = 1 << 20


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class World:
    """Sources and targets of a chunked plan in one process; sources start with `new`."""

    def __init__(self, case, path: str, timeout_s: float = 20.0) -> None:
        self.spec, src_l, self.dst_l = layouts(case)
        self.n_src = src_l.world
        self.src = materialize(src_l, random_full_tensors(self.spec, seed=2))
        self.live = {self.n_src + r: t for r, t in materialize(
            self.dst_l, random_full_tensors(self.spec, seed=1)).items()}
        self.old = {r: {k: v.clone() for k, v in t.items()} for r, t in self.live.items()}
        self.want = {self.n_src + r: t for r, t in materialize(
            self.dst_l, random_full_tensors(self.spec, seed=2)).items()}
        fabric = Fabric()
        out: dict[int, object] = {}

        def load(r: int) -> None:  # every rank loads chunk k before any connects chunk k+1
            if r < self.n_src:
                out[r] = load_chunks(path, r, self.src[r], transport="local", rendezvous=fabric,
                                     timeout_s=timeout_s,
                                     no_identity=True)
            else:
                out[r] = ChunkedShadow.load(path, r, self.live[r], transport="local",
                                            rendezvous=fabric,
                                            timeout_s=timeout_s, no_identity=True)
        ts = [threading.Thread(target=load, args=(r,)) for r in range(self.n_src + len(self.live))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        self.sources = {r: out[r] for r in range(self.n_src)}
        self.targets = {r: out[r] for r in self.live}

    def close(self) -> None:
        for chunks in self.sources.values():
            for ex in chunks:
                ex.close()
        for s in self.targets.values():
            s.close()


def padding_only(got, want, old) -> bool:
    """Bytes that differ from N+1 are bytes no op writes (vocab padding), kept from N."""
    g, n, o = as_bytes(got), as_bytes(want), as_bytes(old)
    diff = g != n
    return bool(diff.any()) and torch.equal(g[diff], o[diff])
