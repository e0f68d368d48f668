"""A stage's packs in groups, each group's writes posted right after it.

A stage that packs or quantizes into staging and then writes what it packed would run all
of its copies before its first write: on a GPU the whole QUANT pass of a stage (a large
share of an FP8 refit's time) before a byte moves. Here the
stage's PACK/QUANT copies are cut into groups in the order of the staging bytes they write
(growing: the first group is small, so the writes start early), and every write of the
stage goes out right after the last group that writes a byte it reads; writes that read
none of them (direct writes from the rank's tensors) go out before the first group. Group
g+1's copies then run while group g's writes are in flight.

The plan does not change: this only orders, within one stage of one rank, what the
executor already ran in that stage, and it keeps every write after every copy that writes
what it reads (byte intervals of `schemas.protocol.copy_footprint`, the same proof as
`verify`'s). A stage whose copies read what its other copies write is left whole.

A grouped stage does not wait for all of the previous stages' writes still in flight before
its first group (as a whole stage's packs must, `core.py`): each group waits only for the
batches in flight that read a byte it writes (`link`: `Stage.blocked`), so the first group
quantizes while the previous stage's last writes land.
"""

from __future__ import annotations

import numpy as np

from schemas.intervals import union
from schemas.plan import PACK, QUANT, RankPlan
from schemas.protocol import copy_footprint

SHARES = (1, 2, 4, 8)
"""Relative sizes (elements copied) of a stage's pack groups, first to last."""


def groups(plan: RankPlan, s: int, want: int, window: int) -> int:
    """Pack groups of stage `s`: `want` (0: none), fewer where a group's batch to each peer
    (and one of writes before the first group) would overflow a `window` of batches."""
    b = plan.batches
    rows = np.flatnonzero(b["stage"] == s)
    if want <= 0 or not len(rows):
        return 0
    dst = plan.writes["dst_rank"]
    peers = len(np.unique(np.concatenate([dst[int(b["start"][i]):int(b["stop"][i])]
                                          for i in rows])))
    return max(1, min(want, window // max(1, peers) - 1))


def beside_quants(plan: RankPlan, prepacked: list[bool]) -> list[bool]:
    """Per stage: its writes may still be in flight while a later stage's QUANTs run early
    (`schemas.protocol` early packs): stage s's packs run during stage s-1, beside the
    writes of s-1 and, where s-2 carried its writes over (nothing arrives for the rank
    there), of s-2. Such writes are `WriteBatch.beside_packs`: a transport that can leave
    the SMs to the quantizer (cuda_ipc: the copy engines, where the copies are large
    enough) does; on the copy kernel the quantizer would wait for every SM it holds
    (FP8 on GPUs, staging halves alternating between rounds)."""
    c = plan.copies
    quant = np.zeros(plan.stages, dtype=bool)
    st = c["stage"][c["kind"] == QUANT].astype(np.int64)
    quant[st[(st >= 0) & (st < plan.stages)]] = True
    out = [False] * plan.stages
    for s in np.flatnonzero(quant & np.asarray(prepacked, dtype=bool)).tolist():
        for k in (s - 1, s - 2):
            if k >= 0:
                out[k] = True
    return out


def region_base(plan: RankPlan) -> np.ndarray:
    """Where each region starts in one address space of the rank's regions (bytes)."""
    base = np.zeros(len(plan.regions) + 1, dtype=np.int64)
    base[1:] = np.cumsum([r.nbytes for r in plan.regions])
    return base


def link(plan: RankPlan, stages: list) -> None:
    """Set `blocked` of every grouped stage: per group of its `pipeline`, the ids of the
    prepared batches (of this or an earlier stage, posted before the group) that read a
    byte the group's copies write; the group runs once none of them is in flight."""
    base = region_base(plan)
    order = [e for st in stages for _, es in (st.pipeline or [([], st.batches)]) for e in es]
    if not order:
        return
    lo = np.concatenate([base[e.batch.src_region] + e.batch.src_offset for e in order])
    hi = lo + np.concatenate([e.batch.nbytes for e in order])
    owner = np.repeat(np.arange(len(order)), [len(e.batch.nbytes) for e in order])
    ids = np.array([id(e) for e in order], dtype=object)
    before = 0  # writes posted before the current entry
    for st in stages:
        st.blocked = []
        for k, (_, entries) in enumerate(st.pipeline or [([], st.batches)]):
            if st.pipeline and k > 0:
                _, reg, glo, ghi = copy_footprint(plan, "dst", st.group_rows[k - 1])
                glo, ghi = _merged(base[reg] + glo, base[reg] + ghi)
                hit = _hits(glo, ghi, lo[:before], hi[:before])
                st.blocked.append(frozenset(ids[np.unique(owner[:before][hit])].tolist()))
            elif st.pipeline:
                st.blocked.append(frozenset())
            before += sum(len(e.batch.nbytes) for e in entries)


def _merged(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of the non-empty intervals `[lo, hi)`, as sorted disjoint intervals."""
    keep = hi > lo
    return union(lo[keep], hi[keep])


def _hits(lo: np.ndarray, hi: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per query interval `[a, b)`: whether it shares a byte with the sorted disjoint
    intervals `[lo, hi)`."""
    if not len(lo):
        return np.zeros(len(a), dtype=bool)
    k = np.searchsorted(lo, b, side="left") - 1  # the last interval starting before b
    return (k >= 0) & (hi[np.maximum(k, 0)] > a) & (b > a)


def split(plan: RankPlan, rows: np.ndarray, writes: np.ndarray, groups: int = len(SHARES)
          ) -> tuple[list[np.ndarray], np.ndarray] | None:
    """Copy rows `rows` (the PACK/QUANT copies of one stage) in at most `groups` groups and,
    per write row of `writes` (that stage's), the last group it must follow (-1: none);
    None where the stage stays whole (fewer than two copies, no write that reads what they
    write, or a copy that reads what another writes)."""
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    writes = np.asarray(writes, dtype=np.int64)
    groups = min(max(1, groups), len(SHARES))
    if len(rows) < 2 or not len(writes):
        return None
    c = plan.copies
    if not np.isin(c["kind"][rows], (PACK, QUANT)).all():
        return None
    base = region_base(plan)  # one address space of the rank's regions
    d_row, d_reg, d_lo, d_hi = copy_footprint(plan, "dst", rows)
    _, s_reg, s_lo, s_hi = copy_footprint(plan, "src", rows)
    d_lo, d_hi = base[d_reg] + d_lo, base[d_reg] + d_hi
    u_lo, u_hi = _merged(d_lo, d_hi)
    if _hits(u_lo, u_hi, base[s_reg] + s_lo, base[s_reg] + s_hi).any():
        return None  # a copy reads what another of the stage writes: keep their order
    w = plan.writes
    a = base[w["src_region"][writes].astype(np.int64)] + w["src_offset"][writes].astype(np.int64)
    b = a + w["nbytes"][writes].astype(np.int64)
    if not _hits(u_lo, u_hi, a, b).any():
        return None
    # copies in the order of the first staging byte they write; groups by elements copied
    first = np.full(len(rows), np.iinfo(np.int64).max, dtype=np.int64)
    at = np.searchsorted(rows, d_row)  # each interval's copy
    np.minimum.at(first, at, d_lo)
    order = np.argsort(first, kind="stable")
    size = np.maximum(c["size0"][rows].astype(np.int64), 1) * np.maximum(
        c["size1"][rows].astype(np.int64), 1) * np.maximum(c["size2"][rows].astype(np.int64), 1)
    done = np.cumsum(size[order])
    shares = np.cumsum(SHARES[:groups])
    cuts = np.searchsorted(done, done[-1] * shares[:-1] / shares[-1], side="left") + 1
    group_of = np.zeros(len(rows), dtype=np.int64)
    group_of[order] = np.searchsorted(cuts, np.arange(len(rows)), side="right")
    kept = [g for g in range(groups) if (group_of == g).any()]
    group_of = np.searchsorted(kept, group_of)  # no empty group
    out = [np.sort(rows[group_of == g]) for g in range(len(kept))]
    dep = np.full(len(writes), -1, dtype=np.int64)
    g_of_interval = group_of[at]
    for g in range(len(out)):
        lo, hi = _merged(d_lo[g_of_interval == g], d_hi[g_of_interval == g])
        dep[_hits(lo, hi, a, b)] = g
    return out, dep
