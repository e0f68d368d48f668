"""What a plan writes into a rank: one definition, read by the compiler and by `verify`.

`outgoing` splits a rank's writes by the peer they land in (`Incoming`: five columns per
write) and `concat` joins the parts a rank receives; `copy_runs` lists the contiguous byte
runs of a rank's strided copies; `written` is "the byte ranges the plan writes" on a rank:
the peers' writes that land in its bound tensors and its own UNPACKs into them, one run per
contiguous byte run, merged. The shadow passes (`planner/passes/shadow.py`,
`planner/passes/chunked.py`) state `written` in the plan; `rdma-plan verify` recomputes it
from the peers' parts and compares (`planner/tools/verify_shadow.py`), and checks each
rank's reads and writes with the same runs (`planner/tools/verify_rank.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from schemas.intervals import union
from schemas.plan import UNPACK, PlanFormatError, RankPlan
from schemas.protocol import ITEM, staging_index, write_stages

MAX_RUNS = 1 << 24
"""Contiguous runs of one copy's box that `copy_runs` lists (a compiled copy has at most a
box's rows)."""
EMPTY = (np.zeros(0, np.int64), np.zeros(0, np.int64))


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
    bounds_ = np.append(first, len(order))
    out = {}
    for j, p in enumerate(peers.tolist()):
        sel = order[bounds_[j]:bounds_[j + 1]]
        lo = w["dst_offset"][sel].astype(np.int64)
        out[p] = Incoming(np.full(len(sel), rp.rank, np.int64),
                          w["dst_region"][sel].astype(np.int64), stage[sel], lo,
                          lo + w["nbytes"][sel])
    return out


def concat(parts: list[Incoming]) -> Incoming:
    if not parts:
        return Incoming.empty()
    return Incoming(*(np.concatenate([getattr(p, f) for p in parts])
                      for f in ("src", "region", "stage", "lo", "hi")))


def _pattern(sizes: tuple[int, ...], strides: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """Start offsets (elements) of the contiguous runs of one box, and the run length. The
    box is a set of elements: its dims are taken by stride, smallest first, and merged
    while each steps exactly over the run so far (a transposed box is one run)."""
    dims = sorted(((n, st) for n, st in zip(sizes, strides) if n > 1), key=lambda d: d[1])
    run = 1
    while dims and dims[0][1] == run:
        run *= dims.pop(0)[0]
    count = math.prod(n for n, _ in dims)
    if count > MAX_RUNS:
        raise PlanFormatError(f"a copy is cut into {count:,} runs, more than verify checks "
                              f"({MAX_RUNS:,}); the plan is corrupt")
    start = np.zeros(1, dtype=np.int64)
    for n, st in dims:
        start = (start[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
    return start, run


def copy_runs(rp: RankPlan, rows: np.ndarray, side: str
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, lo, hi): byte intervals `[lo, hi)` that copies `rows` touch on `side`, one per
    contiguous run of their strided boxes; copies of one box shape share one pattern."""
    c = rp.copies
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return rows, *EMPTY
    key = np.stack([c[f"size{d}"][rows] for d in range(3)]
                   + [c[f"{side}_stride{d}"][rows] for d in range(3)], axis=1).astype(np.int64)
    if (key[:, :3] == 0).any():  # an empty box touches nothing
        keep = (key[:, :3] > 0).all(axis=1)
        rows, key = rows[keep], key[keep]
    order = np.lexsort(key.T[::-1])  # by box shape (a row-wise unique, without its cost)
    key = key[order]
    new = np.ones(len(key), dtype=bool)
    new[1:] = (key[1:] != key[:-1]).any(axis=1)
    cuts = np.append(np.flatnonzero(new), len(key))
    shapes = key[new]
    es = ITEM[np.clip(c[f"{side}_dtype"][rows].astype(np.int64), 0, len(ITEM) - 1)]
    off = c[f"{side}_offset"][rows].astype(np.int64)
    out_r, out_lo, out_hi = [], [], []
    for g, shape in enumerate(shapes.tolist()):
        members = order[cuts[g]:cuts[g + 1]]
        start, run = _pattern(tuple(shape[:3]), tuple(shape[3:]))
        lo = (off[members, None] + start[None, :]) * es[members, None]
        out_r.append(np.repeat(rows[members], len(start)))
        out_lo.append(lo.reshape(-1))
        out_hi.append((lo + run * es[members, None]).reshape(-1))
    return np.concatenate(out_r), np.concatenate(out_lo), np.concatenate(out_hi)


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
