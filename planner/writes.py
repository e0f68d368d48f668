"""What a plan writes into a rank: one definition, read by the compiler and by `verify`.

`outgoing` splits a rank's writes by the peer they land in (`Incoming`: five columns per
write) and `concat` joins the parts a rank receives; `written` is "the byte ranges the plan
writes" on a rank: the peers' writes that land in its bound tensors and its own UNPACKs into
them, one run per contiguous byte run (`schemas.runs.copy_runs`), merged. The shadow passes
(`planner/passes/shadow.py`, `planner/passes/chunked.py`) state `written` in the plan;
`rdma-plan verify` recomputes it from the peers' parts and compares
(`planner/tools/verify_shadow.py`), and checks each rank's reads and writes with the same
runs (`planner/tools/verify_rank.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.intervals import union
from schemas.plan import UNPACK, RankPlan
from schemas.protocol import staging_index, write_stages
from schemas.runs import copy_runs


@dataclass(frozen=True)
class Incoming:
    """The writes of all peers that land in one rank, in source-rank order."""

    src: np.ndarray
    region: np.ndarray
    stage: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @staticmethod
    def empty() -> Incoming:
        z = np.zeros(0, np.int64)
        return Incoming(z, z, z, z, z)


def outgoing(rp: RankPlan) -> dict[int, Incoming]:
    """What `rp`'s writes do to each peer (dst rank -> its `Incoming` part)."""
    w, stage = rp.writes, write_stages(rp)
    dst = w["dst_rank"].astype(np.int64)
    order = np.argsort(dst, kind="stable")
    peers, first = np.unique(dst[order], return_index=True)
    cut = np.append(first, len(order)).tolist()
    # every column sorted by peer once; each peer's part is views of them
    src = np.full(len(order), rp.rank, np.int64)
    region = w["dst_region"][order].astype(np.int64)
    lo = w["dst_offset"][order].astype(np.int64)
    hi = lo + w["nbytes"][order]
    stage = stage[order]
    return {p: Incoming(src[a:b], region[a:b], stage[a:b], lo[a:b], hi[a:b])
            for p, a, b in zip(peers.tolist(), cut, cut[1:])}


def concat(parts: list[Incoming]) -> Incoming:
    if not parts:
        return Incoming.empty()
    return Incoming(*(np.concatenate([getattr(p, f) for p in parts])
                      for f in ("src", "region", "stage", "lo", "hi")))


REGION_SHIFT = 48
"""Intervals of all regions sorted as one key: region << 48 | byte (a region < 2**48 B)."""


def written(rp: RankPlan, inc: Incoming) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(region, offset, nbytes): the disjoint byte runs of `rp`'s bound tensors that the
    plan writes (`inc`: the peers' writes into `rp`), sorted by (region, offset)."""
    sg = staging_index(rp)
    keep = inc.region != sg
    rows, u_lo, u_hi = copy_runs(rp, np.flatnonzero(rp.copies["kind"] == UNPACK), "dst")
    u_reg = rp.copies["dst_region"][rows].astype(np.int64)
    u_keep = u_reg != sg
    reg = np.concatenate([inc.region[keep], u_reg[u_keep]]).astype(np.int64) << REGION_SHIFT
    lo, hi = union(np.concatenate([inc.lo[keep], u_lo[u_keep]]) + reg,
                   np.concatenate([inc.hi[keep], u_hi[u_keep]]) + reg)
    region = lo >> REGION_SHIFT
    return region, lo - (region << REGION_SHIFT), hi - lo
