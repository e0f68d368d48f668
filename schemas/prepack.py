"""Which stages' packs run early: the one overlap rule of the stage protocol.

A source's stage s runs its PACK and QUANT copies, then posts its writes (`schemas.plan`,
steps 2-3); done in that order every stage pays its pack time with the NIC idle. A stage
`s >= 1` is *prepacked* instead: its copies run on the rank while the writes of stage
`s - 1` are in flight (right after that stage's first batches are posted), when that
cannot change what any byte holds:
  1. none of its copies reads staging (they read only the rank's own tensors, which do
     not change during a step; a copy that reads staging reads what a peer or an earlier
     pack put there, which may not be there yet);
  2. the staging bytes its copies write are disjoint from every staging byte that stages
     `s - 1` and `s - 2` read on this rank: the sources of their writes and of their
     unpacks. (The executor may still have writes of those stages in flight: it goes on
     to the next stage before the previous one has landed where nothing arrives for the
     rank, `executor/window.py`. Writes of older stages that read those bytes, if any are
     still in flight, land first: `Overlap.blockers`.)
The compiler places the packs of consecutive stages in thirds of staging, in turn
(`planner/passes/lower.py`), so that the rule holds; `rdma-plan verify` also checks that
no peer's write lands in the bytes a prepacked stage packs during the previous stage.
The executor and the simulator both apply `prepacked` (one implementation), and the plan
alone decides it: nothing here depends on the run.
"""

from __future__ import annotations

import numpy as np

from schemas.plan import DTYPE_CODES, ITEMSIZE, PACK, QUANT, STAGING, UNPACK, RankPlan

_ITEM = np.array([ITEMSIZE[d] for d in DTYPE_CODES], dtype=np.int64)
SLOTS = 3
"""The compiler gives stage s the slot `s % SLOTS` of the staging budget; the rule checks
the `SLOTS - 1` stages before s."""


def staging_index(rp: RankPlan) -> int:
    """Index of the rank's staging region, or -1 if it has none."""
    return len(rp.regions) - 1 if rp.regions and rp.regions[-1].name == STAGING else -1


def write_stages(rp: RankPlan) -> np.ndarray:
    """The stage of every write of the rank (from its batches; writes no batch covers:
    stage 0)."""
    b, n = rp.batches, len(rp.writes)
    start, stop = b["start"].astype(np.int64), b["stop"].astype(np.int64)
    if len(b) and start[0] == 0 and stop[-1] == n and (stop >= start).all() \
            and np.array_equal(start[1:], stop[:-1]):
        return np.repeat(b["stage"].astype(np.int64), stop - start)
    stage = np.zeros(n, dtype=np.int64)  # a malformed plan (`verify` reports it)
    for a, z, s in zip(start.tolist(), stop.tolist(), b["stage"].tolist()):
        stage[max(a, 0):max(z, 0)] = s
    return stage


def copy_extents(rp: RankPlan, side: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Byte intervals `[lo, hi)` holding everything copies `rows` touch on `side` (their
    boxes' extents; a QUANT's destination also holds its scales at `aux_offset`)."""
    c = rp.copies
    es = _ITEM[c[f"{side}_dtype"][rows].astype(np.int64)]
    lo = c[f"{side}_offset"][rows].astype(np.int64)
    hi = lo + 1
    for d in range(3):
        hi = hi + (c[f"size{d}"][rows].astype(np.int64) - 1) * c[f"{side}_stride{d}"][rows]
    lo, hi = lo * es, hi * es
    if side == "dst":
        q = c["kind"][rows] == QUANT
        if q.any():
            blocks = (-(-c["size0"][rows][q] // 128)) * (-(-c["size1"][rows][q] // 128))
            a = c["aux_offset"][rows][q].astype(np.int64) * 4
            lo, hi = np.concatenate([lo, a]), np.concatenate([hi, a + 4 * blocks])
    return lo, hi


def overlaps(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether any interval of `a` shares a byte with any interval of `b`."""
    (a_lo, a_hi), (b_lo, b_hi) = a, b
    keep_a, keep_b = a_hi > a_lo, b_hi > b_lo
    a_lo, a_hi, b_lo, b_hi = a_lo[keep_a], a_hi[keep_a], b_lo[keep_b], b_hi[keep_b]
    if not len(a_lo) or not len(b_lo):
        return False
    order = np.argsort(b_lo, kind="stable")
    b_lo, b_hi = b_lo[order], np.maximum.accumulate(b_hi[order])
    k = np.searchsorted(b_lo, a_hi, side="left") - 1  # last b starting before a ends
    return bool(((k >= 0) & (b_hi[np.maximum(k, 0)] > a_lo)).any())


class Overlap:
    """The rule applied to one rank: `prepacked[s]`, and per stage the staging bytes it
    reads (`reads`: sources of its writes and unpacks) and its packs write (`packs`)."""

    def __init__(self, rp: RankPlan) -> None:
        self.prepacked = np.zeros(rp.stages, dtype=bool)
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self.reads = [empty] * rp.stages
        self.packs = [empty] * rp.stages
        sg = staging_index(rp)
        c = rp.copies
        if sg < 0 or rp.stages < 2 or not len(c):
            return
        w, w_stage = rp.writes, write_stages(rp)
        ok = (w_stage >= 0) & (w_stage < rp.stages) & (w["src_region"] == sg)
        unp = np.flatnonzero((c["kind"] == UNPACK) & (c["src_region"] == sg)
                             & (c["stage"] >= 0) & (c["stage"] < rp.stages))
        u_lo, u_hi = copy_extents(rp, "src", unp)
        for st in np.unique(np.concatenate([w_stage[ok], c["stage"][unp]])).tolist():
            sel, us = np.flatnonzero(ok & (w_stage == st)), c["stage"][unp] == st
            lo = w["src_offset"][sel].astype(np.int64)
            self.reads[st] = (np.concatenate([lo, u_lo[us]]),
                              np.concatenate([lo + w["nbytes"][sel], u_hi[us]]))
        packing = (c["kind"] == PACK) | (c["kind"] == QUANT)
        for st in np.unique(c["stage"][packing]).tolist():
            if st < 1 or st >= rp.stages:
                continue
            mine = np.flatnonzero(packing & (c["stage"] == st))
            self.packs[st] = copy_extents(rp, "dst", mine)
            if (c["src_region"][mine] == sg).any() or (c["dst_region"][mine] != sg).any():
                continue  # rule 1 (and a pack into a tensor is never early)
            if any(overlaps(self.packs[st], self.reads[k])
                   for k in range(max(st - SLOTS + 1, 0), st)):
                continue  # rule 2
            self.prepacked[st] = True

    def blockers(self, s: int, inflight: set[int] | list[int]) -> list[int]:
        """Stages among `inflight` (older than the rule covers) whose writes read staging
        that the early packs of stage `s` write: they must land first."""
        return sorted(k for k in inflight
                      if k <= s - SLOTS and overlaps(self.packs[s], self.reads[k]))


def prepacked(rp: RankPlan) -> np.ndarray:
    """`out[s]`: stage s's PACK/QUANT copies run during stage s-1's writes (module doc)."""
    return Overlap(rp).prepacked
