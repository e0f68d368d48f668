"""`verify`'s checks of one rank's decoded part (`planner/tools/verify.py` runs them rank by rank).

Each function takes one `RankPlan` and, where a check needs its peers, a small summary of
what they do to it (`Incoming`: the writes that land in this rank, five columns per write),
never the whole plan: `verify` holds one rank's columns at a time, plus those summaries.
The executor can run the checks that need no peer (`rank_bounds`, `rank_sizes`) at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.rows import lexorder
from planner.writes import Incoming
from schemas.bounds import violations
from schemas.errors import PlanFormatError
from schemas.header import PlanHeader
from schemas.intervals import first_overlap_by_group, outside_by_group, overlap_by_group
from schemas.plan import PACK, QUANT, STAGING, UNPACK, RankPlan
from schemas.protocol import (
    ALIGN,
    SCALE_BYTES,
    SLOTS,
    copy_footprint,
    overlap,
    quant_scales,
    staging_index,
    write_footprint,
    write_stages,
)
from schemas.runs import MAX_COPY_RUNS, copy_runs
from schemas.table import content_key, table_digest

MAX_RUNS = MAX_COPY_RUNS

# ---------------------------------------------------------------- checks of one rank alone

def rank_bounds(rp: RankPlan, world: int | None) -> str | None:
    """The executor's load-time bounds proof (`schemas.bounds`) against the rank's own
    `peer_regions`; `verify` then checks those against the peers' real regions."""
    return next(violations(rp, world), None)


def rank_sizes(rp: RankPlan, max_write: int | None, budget: int | None) -> list[str]:
    """No write above `max_write_bytes`, no staging above `staging_bytes`."""
    out = []
    if max_write and len(rp.writes) and rp.writes["nbytes"].max() > max_write:
        out.append(f"rank {rp.rank}: a write of {rp.writes['nbytes'].max()} bytes exceeds "
                   f"max_write_bytes={max_write}")
    for r in rp.regions:
        if r.name == STAGING and budget is not None and r.nbytes > budget:
            out.append(f"rank {rp.rank}: staging of {r.nbytes} bytes exceeds "
                       f"staging_bytes={budget}")
    return out


def rank_egress(rp: RankPlan) -> int:
    """Bytes the rank's first NIC sends per run (its remote batches: `nic == 0`)."""
    b = rp.batches
    if rp.role != "source" or not rp.nics or not len(b):
        return 0
    cs = np.concatenate([[0], np.cumsum(rp.writes["nbytes"], dtype=np.int64)])
    m = b["nic"] == 0
    return int((cs[b["stop"][m]] - cs[b["start"][m]]).sum())


# ---------------------------------------------------------------- byte intervals

def quant_runs(rp: RankPlan, region: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stage, lo, hi): byte intervals QUANT copies write in `region`: each row of their
    e4m3 box and of their scales (`schemas.protocol.quant_scales`), with its copy's stage."""
    c = rp.copies
    rows = np.flatnonzero((c["kind"] == QUANT) & (c["dst_region"] == region))
    a, rb, cb, st = quant_scales(rp, rows)
    m, n = c["size0"][rows].astype(np.int64), c["size1"][rows].astype(np.int64)
    if int(m.sum() + rb.sum()) > MAX_RUNS * 4:
        raise PlanFormatError(f"rank {rp.rank}: its QUANTs write over {MAX_RUNS * 4:,} rows; "
                              "the plan is corrupt")
    # one interval per e4m3 row, then one per scale row, each tagged with its copy's stage;
    # a box whose rows follow one another (stride = row length) is one interval
    e_lo, e_hi, e_rep = _row_runs(c["dst_offset"][rows].astype(np.int64), m, n,
                                  c["dst_stride0"][rows].astype(np.int64))
    s_lo, s_hi, s_rep = _row_runs(a, rb, cb, st)
    stage = c["stage"][rows].astype(np.int64)
    return (np.concatenate([stage[e_rep], stage[s_rep]]),
            np.concatenate([e_lo, s_lo * SCALE_BYTES]),
            np.concatenate([e_hi, s_hi * SCALE_BYTES]))


def _row_runs(off: np.ndarray, rows: np.ndarray, width: np.ndarray, stride: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, box) of the rows of boxes (`rows` rows of `width` elements, `stride` apart,
    from `off`): one interval per row, or per box where its rows are adjacent."""
    whole = (stride == width) | (rows <= 1)
    count = np.where(whole, np.minimum(rows, 1), rows)
    length = np.where(whole, rows * width, width)
    rep = np.repeat(np.arange(len(off)), count)
    k = np.arange(len(rep)) - np.repeat(np.cumsum(count) - count, count)
    lo = off[rep] + k * stride[rep]
    return lo, lo + length[rep], rep


# ---------------------------------------------------------------- checks with the peers' part

def rank_coverage(rp: RankPlan, inc: Incoming, staging: int
                  ) -> tuple[list[str], tuple[np.ndarray, np.ndarray]]:
    """Writes and unpacks into `rp` never overlap (staging: per stage); and bytes written
    per run into each of its regions (the regions written, sorted, and their bytes), for
    the coverage table. One sort by (region, stage, start) groups them all."""
    u_rows, u_lo, u_hi = copy_runs(rp, np.flatnonzero(rp.copies["kind"] == UNPACK), "dst")
    stage = np.where(inc.region == staging, inc.stage, -1) if staging >= 0 else \
        np.full(len(inc.region), -1, np.int64)
    reg = np.concatenate([inc.region, rp.copies["dst_region"][u_rows].astype(np.int64)])
    st = np.concatenate([stage, np.full(len(u_rows), -1, np.int64)])
    lo, hi = np.concatenate([inc.lo, u_lo]), np.concatenate([inc.hi, u_hi])
    order = lexorder(lo, st, reg)
    reg, st, lo, hi = reg[order], st[order], lo[order], hi[order]
    new = np.ones(len(reg), dtype=bool)
    new[1:] = (reg[1:] != reg[:-1]) | (st[1:] != st[:-1])
    group = np.cumsum(new) - 1
    bad = np.flatnonzero(~new[1:] & (lo[1:] < hi[:-1])) + 1
    out = []
    _, first = np.unique(group[bad], return_index=True)
    for i in bad[first].tolist():
        r, s = int(reg[i]), int(st[i])
        name = rp.regions[r].name if 0 <= r < len(rp.regions) else str(r)
        out.append(f"rank {rp.rank} {name}: writes overlap at byte {int(lo[i])}"
                   + (f" in stage {s}" if s >= 0 else ""))
    whole = st == -1
    regs, at = np.unique(reg[whole], return_index=True)
    sums = np.add.reduceat(hi[whole] - lo[whole], at) if len(at) else at
    return out, (regs, sums)


def rank_dataflow(rp: RankPlan, inc: Incoming) -> list[str]:
    """Staging a write reads holds data: filled by this stage's packs or QUANTs, or by the
    previous stage's packs, QUANTs and landed writes (a gather: its DONE is awaited first;
    an FP8 gather's QUANTs read in place, in the gather stage of their round); early
    packs never overwrite what the previous stage's writes land in; unpacks read landed
    bytes. Every stage at once: intervals are grouped by the stage they serve."""
    sg = staging_index(rp)
    if sg < 0:
        return []  # (nothing lands in staging, nor is read from it; no stage packs early)
    out: list[str] = []
    m = inc.region == sg
    land = (inc.stage[m], inc.lo[m], inc.hi[m])
    w, stage = rp.writes, write_stages(rp)
    own = own_staging(rp, sg)
    p_st, p_lo, p_hi = own.packs
    for s in own.pack_overlaps:
        out.append(f"rank {rp.rank}: packs of stage {s} overlap in staging")
    q_st, q_lo, q_hi = own.quants
    sel = np.flatnonzero(w["src_region"] == sg)
    lo = w["src_offset"][sel].astype(np.int64)
    # stage s reads what its packs and QUANTs and stage s-1's packs, QUANTs and landed
    # writes fill
    f_st, f_lo, f_hi = cat3((p_st, p_lo, p_hi), (p_st + 1, p_lo, p_hi), (q_st, q_lo, q_hi),
                            (q_st + 1, q_lo, q_hi), (land[0] + 1, land[1], land[2]))
    bad = outside_by_group(stage[sel], lo, lo + w["nbytes"][sel], f_st, f_lo, f_hi)
    stages, first = np.unique(stage[sel][bad], return_index=True)
    for s, i in zip(stages.tolist(), sel[bad][first].tolist()):
        out.append(f"rank {rp.rank}: write {i} (stage {s}) reads staging bytes that no pack "
                   "of its stage fills")
    ov = overlap(rp)
    early = np.flatnonzero(ov.prepacked)
    if len(early):  # packs while writes may still land: what the early stages' packs and
        # QUANTs write (`Overlap.packs`: their footprints, a QUANT's scales too, by stage)
        e_st = np.repeat(early, [len(ov.packs[s][0]) for s in early.tolist()])
        lo = np.concatenate([ov.packs[s][0] for s in early.tolist()])
        hi = np.concatenate([ov.packs[s][1] for s in early.tolist()])
        hit = overlap_by_group(e_st, lo, hi, land[0] + 1, land[1], land[2])
        for s in np.unique(e_st[hit]).tolist():
            out.append(f"rank {rp.rank}: stage {s} packs early (schemas/protocol.py) into "
                       f"staging bytes that writes of stage {s - 1} land in")
    u_st, lo, hi = own.unpacks
    for s in np.unique(u_st[outside_by_group(u_st, lo, hi, *land)]).tolist():
        out.append(f"rank {rp.rank}: an unpack of stage {s} reads staging bytes that no "
                   "write of its stage fills")
    return out


@dataclass(frozen=True, slots=True)
class OwnStaging:
    """What `rank_dataflow` reads of a rank's own copies in its staging: (stage, lo, hi) of
    its packs' runs, the stages whose packs overlap, its QUANTs' runs and its unpacks'
    runs. The same for every rank with equal copies (and staging index): `own_staging`."""

    packs: tuple[np.ndarray, np.ndarray, np.ndarray]
    pack_overlaps: tuple[int, ...]
    quants: tuple[np.ndarray, np.ndarray, np.ndarray]
    unpacks: tuple[np.ndarray, np.ndarray, np.ndarray]


_OWN: dict[bytes, OwnStaging] = {}
OWN_BYTES = 128 << 20
"""Bytes of runs `own_staging` keeps; beyond them it starts again."""
_own_bytes = [0]


def own_staging(rp: RankPlan, sg: int) -> OwnStaging:
    """`OwnStaging` of `rp` (`sg`: its staging index), made once for ranks with equal copies
    (every shard of a pipeline stage, every replica), kept by a digest of them
    (`schemas.table.content_key`); a rank whose copies fail a check raises each time."""
    key = content_key(table_digest(rp.copies), sg)
    got = _OWN.get(key)
    if got is not None:
        return got
    c = rp.copies
    rows, p_lo, p_hi = copy_runs(rp, np.flatnonzero((c["kind"] == PACK)
                                                    & (c["dst_region"] == sg)), "dst")
    p_st = c["stage"][rows].astype(np.int64)
    overlapping = tuple(first_overlap_by_group(p_st, p_lo, p_hi).tolist())
    quants = quant_runs(rp, sg)
    rows, u_lo, u_hi = copy_runs(rp, np.flatnonzero((c["kind"] == UNPACK)
                                                    & (c["src_region"] == sg)), "src")
    u_st = c["stage"][rows].astype(np.int64)
    got = OwnStaging((p_st, p_lo, p_hi), overlapping, quants, (u_st, u_lo, u_hi))
    arrays = (*got.packs, *got.quants, *got.unpacks)
    for a in arrays:
        a.flags.writeable = False
    size = sum(a.nbytes for a in arrays)
    if _own_bytes[0] + size > OWN_BYTES:
        _OWN.clear()
        _own_bytes[0] = 0
    _OWN[key] = got
    _own_bytes[0] += size
    return got


def cat3(*parts: tuple[np.ndarray, np.ndarray, np.ndarray]
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.concatenate([np.zeros(0, np.int64), *(p[i] for p in parts)]  # type: ignore
                                ).astype(np.int64) for i in range(3))


def staging_use(rp: RankPlan, inc: Incoming) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stage, lo, hi) of staging byte intervals the rank's ops touch: its writes' sources,
    peers' writes into it, and both sides of its copies, these as one interval a stage
    from the first byte they touch in it to the last (`copy_use`): each stage's first and
    last bytes, and the last of all, are those of every interval."""
    sg, stage = staging_index(rp), write_stages(rp)
    reg, lo, hi = write_footprint(rp, "src")
    parts = [(stage[reg == sg], lo[reg == sg], hi[reg == sg])]
    m = inc.region == sg
    parts.append((inc.stage[m], inc.lo[m], inc.hi[m]))
    parts.append(copy_use(rp, sg))
    return tuple(np.concatenate([p[i] for p in parts]).astype(np.int64)  # type: ignore
                 for i in range(3))


_USE: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
USE_MAX = 4096


def copy_use(rp: RankPlan, sg: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stage, lo, hi): for each stage in which the rank's copies touch bytes of its
    staging (`sg`; either side), the first and the one past the last (empty boxes touch
    nothing). Made once for ranks with equal copies, kept by a digest of them."""
    key = content_key(table_digest(rp.copies), sg)
    got = _USE.get(key)
    if got is not None:
        return got
    st, lo, hi = [], [], []
    for side in ("src", "dst"):
        rows, reg, a, b = copy_footprint(rp, side)
        m = (reg == sg) & (b > a)
        st.append(rp.copies["stage"][rows[m]].astype(np.int64))
        lo.append(a[m])
        hi.append(b[m])
    st_, lo_, hi_ = np.concatenate(st), np.concatenate(lo), np.concatenate(hi)
    stages, inv = np.unique(st_, return_inverse=True)
    first = np.full(len(stages), np.iinfo(np.int64).max)
    last = np.zeros(len(stages), np.int64)
    np.minimum.at(first, inv.reshape(-1), lo_)
    np.maximum.at(last, inv.reshape(-1), hi_)
    got = (stages.astype(np.int64), first, last)
    for a in got:
        a.flags.writeable = False
    if len(_USE) >= USE_MAX:
        _USE.clear()
    _USE[key] = got
    return got


def rank_staging_fit(rp: RankPlan, inc: Incoming) -> list[str]:
    """No rank's staging exceeds what its ops use at peak: it ends at the last staging byte
    they touch (rounded up to `ALIGN`), and it is at most the bytes the `SLOTS` stages
    that use the most touch (a stage's use: from its first to its last byte; the rotation
    keeps up to `SLOTS` stages' staging live at once), plus `ALIGN` per slot."""
    stage, lo, hi = staging_use(rp, inc)
    have = rp.regions[-1].nbytes
    keep = hi > lo
    stage, lo, hi = stage[keep], lo[keep], hi[keep]
    end = -(-int(hi.max(initial=0)) // ALIGN) * ALIGN
    first = np.full(int(stage.max(initial=-1)) + 1, np.iinfo(np.int64).max)
    last = np.zeros(len(first), dtype=np.int64)
    np.minimum.at(first, stage, lo)
    np.maximum.at(last, stage, hi)
    span = np.sort(np.where(last > 0, last - first, 0))[::-1]
    peak = int(span[:SLOTS].sum()) + SLOTS * ALIGN
    if have > min(end, peak):
        return [f"rank {rp.rank}: staging of {have} bytes exceeds what its ops use at peak "
                f"(they touch bytes up to {end}; its {SLOTS} busiest stages "
                f"{peak - SLOTS * ALIGN})"]
    return []


def acyclic(n: int, u: np.ndarray, v: np.ndarray) -> bool:
    """Whether the graph of `n` nodes and edges `u -> v` has no cycle (Kahn's algorithm, one
    numpy step per level; an edge naming no node is a cycle: the DAG is malformed)."""
    u, v = u.astype(np.int64), v.astype(np.int64)
    if len(u) and (min(u.min(), v.min()) < 0 or max(u.max(), v.max()) >= n):
        return False
    order = np.argsort(u, kind="stable")
    v = v[order]
    start = np.searchsorted(u[order], np.arange(n + 1))
    indeg = np.bincount(v, minlength=n)
    frontier = np.flatnonzero(indeg == 0)
    seen = 0
    while len(frontier):
        seen += len(frontier)
        lo, hi = start[frontier], start[frontier + 1]
        count = hi - lo
        idx = np.repeat(lo - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
        succ = v[idx]
        before = indeg[succ] > 0
        np.subtract.at(indeg, succ, 1)
        frontier = np.unique(succ[before & (indeg[succ] == 0)])
    return seen == n


def balance_msgs(header: PlanHeader, egress: dict[str, int], replicated: bool | None
                 ) -> list[str]:
    """No source NIC sends more than the mean plus one unit (a replicated source only)."""
    if not (header.source_replicated if replicated is None else replicated):
        return []
    if len(egress) < 2:
        return []
    slack = max(header.options.max_write_bytes, header.model.longest_row_bytes,
                header.stats.gather_unit_max)
    mean = sum(egress.values()) / len(egress)
    name, most = max(egress.items(), key=lambda kv: kv[1])
    if most > mean + slack:
        return [f"NIC {name} sends {most} bytes, more than the mean {mean:.0f} over "
                f"{len(egress)} source NICs plus one unit ({slack} bytes)"]
    return []
