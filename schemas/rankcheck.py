"""The per-rank checks of `verify` that need one rank's plan and the header only: the
executor runs them at load (`executor/check.py`), `rdma-plan verify` runs them on every
rank (`planner/tools/verify.py`), so a plan `verify` refuses for one of these reasons never runs.

- `roles`: each op writes only the memory its role may. A source's copies (PACK, QUANT)
  write only its staging; a target's copies (UNPACK) write its own tensors, never its
  staging; a write into a source peer lands only in that peer's staging (a gather), never
  in its registered weights. (The kinds each role runs, and every op inside its regions:
  `schemas.bounds`.)
- `sizes`: no write above `options.max_write_bytes`, staging within `options.staging_bytes`.
- `signals`: a rank that writes to a peer in stage s sends that peer DONE in stage s and
  waits for its READY (stage 0): writes never land unannounced or into a busy target.
- `regions`: every region of the rank has its own name (two regions of one name would bind
  one tensor twice), one staging at most, and last.
- `packs`: the rank's own PACKs of one stage never write a common byte of its staging (the
  rule of `verify`'s `dataflow` that needs no peer), decided on the bytes of their strided
  boxes (`schemas/runs.py`), not their extents: packs that interleave (even and odd rows of
  one block) without sharing a byte are valid. Only packs whose extents overlap are cut into
  runs, `MAX_CHECK_RUNS` at a time (a compiled pack writes dense staging: one run).
- `unpacks`: the rank's own UNPACKs never write a common byte of its tensors (the part of
  `verify`'s `coverage` that needs no peer: a tensor byte is written once a run), by the
  same runs.
- `shadow`: a shadow section's own rules (`schemas/shadow.py`).
`RULES` names them; with `schemas.bounds` they are every rule of `verify` that one rank's
part decides (tests/schemas/test_rank_rules.py breaks each and shows load refuses it).

What verify checks that is not here, and why: `coverage` (every logical byte written once)
and `dataflow`/`staging_fit` need the writes of every peer into this rank; `order` pairs
signals across ranks and walks the stage DAG; `balance` sums the NICs of every source. Each
needs the other ranks' blobs: a rank reads only its own (a world of thousands of ranks, each
reading every blob, is quadratic). Those plans are caught where the plan is signed (the key
holder ran `verify`) or, for a tampered unsigned plan, not at all: `docs/reliability.md`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from .header import PlanHeader
from .plan import DONE, PACK, QUANT, READY, STAGING, UNPACK, RankPlan, region_facts
from .protocol import copy_footprint, staging_index, wait_stage, write_stages
from .runs import copy_runs, row_runs
from .shadow import shadow_violations

FIX = "the plan is corrupt or was tampered with: recompile it"
RULES = ("roles", "sizes", "signals", "regions", "packs", "unpacks", "shadow")
MAX_CHECK_RUNS = 1 << 22
"""Runs that `packs` and `unpacks` list at a time (memory): copies whose extents chain into
one another (a cluster, byte-disjoint from the others) are cut into runs a few clusters at a
time; one cluster past it (a tensor of over 4 M rows cut across) is refused."""


def peer_roles(header: PlanHeader) -> list[str] | None:
    """The role of every rank per the header (None where the header does not say)."""
    if header.world and len(header.ranks) == header.world:
        return [r.role for r in header.ranks]
    if header.world and header.sources:
        return ["source" if r < header.sources else "target" for r in range(header.world)]
    return None


def header_staging(header: PlanHeader) -> list[int] | None:
    """Staging bytes of every rank per the header (None where the header does not say)."""
    if header.world and len(header.rank_stats) == header.world:
        return [s.staging for s in header.rank_stats]
    return None


def roles(rp: RankPlan, roles_: Sequence[str] | None = None,
          peer_staging: dict[int, int] | None = None,
          staging_bytes: Sequence[int] | None = None) -> Iterator[str]:
    """Messages of the role checks `rp` fails. `roles_`: every rank's role; `peer_staging`:
    the staging region index of each peer (-1: none), where known (verify); else
    `staging_bytes`: each rank's staging size (the header's `rank_stats`), which a write into
    a source peer's region must match (the executor at load; exact again at connect)."""
    c, sg, where = rp.copies, staging_index(rp), f"rank {rp.rank}"
    packs = np.isin(c["kind"], (PACK, QUANT))
    bad = np.flatnonzero(packs & (c["dst_region"] != sg))
    if len(bad):
        i = int(bad[0])
        yield (f"{where}: copy {i} (a PACK or QUANT) writes region {int(c['dst_region'][i])}"
               f"{_name(rp, int(c['dst_region'][i]))}, not its staging; a source's copies "
               f"write only staging, never its weights ({len(bad)} such copies); {FIX}")
    bad = np.flatnonzero((c["kind"] == UNPACK) & (c["dst_region"] == sg))
    if len(bad):
        yield (f"{where}: copy {int(bad[0])} (an UNPACK) writes into its own staging; an "
               f"unpack writes the target's tensors ({len(bad)} such copies); {FIX}")
    if roles_ is None:
        return
    w = rp.writes
    for peer in np.unique(w["dst_rank"]).tolist():
        if not 0 <= peer < len(roles_) or roles_[peer] != "source":
            continue
        sel = np.flatnonzero(w["dst_rank"] == peer)
        regs = w["dst_region"][sel]
        if peer_staging is not None:
            bad = sel[regs != peer_staging.get(peer, -1)]
        elif staging_bytes is not None and 0 <= peer < len(staging_bytes):
            size = dict(dict(rp.peer_regions).get(peer, ()))
            want = staging_bytes[peer]
            bad = sel[[not want or size.get(int(r)) != want for r in regs.tolist()]]
        else:
            continue
        if len(bad):
            i = int(bad[0])
            yield (f"{where}: write {i} lands in region {int(w['dst_region'][i])} of source "
                   f"rank {peer}, which is not that rank's staging; a source's weights are "
                   f"never written ({len(bad)} such writes); {FIX}")


def _name(rp: RankPlan, region: int) -> str:
    return f" ({rp.regions[region].name})" if 0 <= region < len(rp.regions) else ""


def sizes(rp: RankPlan, max_write_bytes: int, staging_bytes: int | None) -> Iterator[str]:
    """Writes within `max_write_bytes` (0: no cap), staging within `staging_bytes`."""
    w = rp.writes
    if max_write_bytes and len(w) and int(w["nbytes"].max()) > max_write_bytes:
        yield (f"rank {rp.rank}: a write of {int(w['nbytes'].max())} bytes exceeds "
               f"max_write_bytes={max_write_bytes}")
    for r in rp.regions:
        if r.name == STAGING and staging_bytes is not None and r.nbytes > staging_bytes:
            yield (f"rank {rp.rank}: staging of {r.nbytes} bytes exceeds "
                   f"staging_bytes={staging_bytes}")


def signals(rp: RankPlan) -> Iterator[str]:
    """Every (stage, peer) this rank writes to has its DONE sent and the peer's READY
    awaited."""
    w = rp.writes
    if not len(w):
        return
    pairs = np.unique(np.stack([write_stages(rp), w["dst_rank"].astype(np.int64)]), axis=1)
    sent = set(zip(rp.signals["stage"].tolist(), rp.signals["peer"].tolist(),
                   rp.signals["kind"].tolist()))
    waited = set(zip(rp.waits["stage"].tolist(), rp.waits["peer"].tolist(),
                     rp.waits["kind"].tolist()))
    ready = int(wait_stage(READY, 0))
    for s, p in pairs.T.tolist():
        if (s, p, DONE) not in sent or (ready, p, READY) not in waited:
            yield (f"rank {rp.rank} writes to rank {p} in stage {s} without READY and DONE "
                   f"signals; {FIX}")
            return


def regions(rp: RankPlan) -> Iterator[str]:
    """Region names unique; staging, where there is one, the last region."""
    names = region_facts(rp.regions).names
    if len(set(names)) == len(names) and (STAGING not in names or names[-1] == STAGING):
        return
    seen: set[str] = set()
    for i, g in enumerate(rp.regions):
        if g.name in seen:
            yield (f"rank {rp.rank}: region {i} is named {g.name[:80]!r} like an earlier "
                   f"region; each region binds its own tensor; {FIX}")
            return
        seen.add(g.name)
    if STAGING in seen and rp.regions[-1].name != STAGING:
        yield f"rank {rp.rank}: its staging region is not its last region; {FIX}"


def packs(rp: RankPlan) -> Iterator[str]:
    """No two PACKs of one stage write a common byte of the rank's staging."""
    c, sg = rp.copies, staging_index(rp)
    rows = np.flatnonzero((c["kind"] == PACK) & (c["dst_region"] == sg)) if sg >= 0 else []
    yield from _apart(rp, np.asarray(rows, np.int64), "stage", "PACK", "of its stage")


def unpacks(rp: RankPlan) -> Iterator[str]:
    """No two UNPACKs of the rank write a common byte of one of its tensors (in any stage:
    a tensor byte is written once per run)."""
    c = rp.copies
    rows = np.flatnonzero(c["kind"] == UNPACK)
    yield from _apart(rp, rows, "dst_region", "UNPACK", "into its region")


def _apart(rp: RankPlan, rows: np.ndarray, by: str, kind: str, where: str
           ) -> Iterator[str]:
    """No two copies `rows` (PACKs or UNPACKs) with one value of column `by` write a common
    dst byte: the copies whose extents overlap another's of their group (after
    `schemas.bounds`, whose value checks keep the extents exact int64) are cut into their
    runs, which must not overlap."""
    if len(rows) < 2:
        return
    col = rp.copies[by]
    rows, _, lo, hi = copy_footprint(rp, "dst", rows)  # one interval a row (no QUANT)
    group = col[rows].astype(np.int64)
    keep = hi > lo
    group, lo, hi, rows = group[keep], lo[keep], hi[keep], rows[keep]
    order = np.lexsort((lo, group))
    group, lo, hi, rows = group[order], lo[order], hi[order], rows[order]
    cuts = np.flatnonzero(np.r_[True, group[1:] != group[:-1], True])
    reach = np.concatenate([np.maximum.accumulate(hi[a:b])  # per group
                            for a, b in zip(cuts[:-1], cuts[1:])])
    joins = np.r_[False, (group[1:] == group[:-1]) & (lo[1:] < reach[:-1])]
    if not joins.any():
        return  # no two extents meet: no common byte
    cluster = np.cumsum(~joins)  # copies whose extents chain into one another, per group
    many = np.bincount(cluster)[cluster] > 1
    cand, cluster = rows[many], cluster[many]  # by cluster (sorted), byte-disjoint clusters
    n = row_runs(rp, cand, "dst")
    ends = np.flatnonzero(np.r_[cluster[1:] != cluster[:-1], True]) + 1
    sizes = np.add.reduceat(n, np.r_[0, ends[:-1]])
    if int(sizes.max()) > MAX_CHECK_RUNS:
        yield (f"rank {rp.rank}: {kind}s whose extents overlap are cut into "
               f"{int(sizes.max()):,} runs in one place, more than load checks at once "
               f"({MAX_CHECK_RUNS:,}); {FIX}")
        return
    start = 0
    while start < len(cand):  # whole clusters, at most MAX_CHECK_RUNS runs at a time
        total = np.cumsum(n[start:])
        stop = ends[np.searchsorted(ends, start + int(np.searchsorted(
            total, MAX_CHECK_RUNS, side="right")), side="right") - 1]
        stop = max(stop, int(ends[np.searchsorted(ends, start, side="right")]))
        msg = _overlap(rp, cand[start:stop], col, kind, where, by)
        if msg:
            yield msg
            return
        start = stop


def _overlap(rp: RankPlan, rows: np.ndarray, col: np.ndarray, kind: str, where: str,
             by: str) -> str | None:
    """The first byte two of `rows` with one value of `col` both write, as a message."""
    r, lo, hi = copy_runs(rp, rows, "dst")
    g = col[r].astype(np.int64)
    order = np.lexsort((lo, g))
    r, lo, hi, g = r[order], lo[order], hi[order], g[order]
    bad = np.flatnonzero((g[1:] == g[:-1]) & (lo[1:] < hi[:-1]))
    if not len(bad):
        return None
    i = int(bad[0]) + 1
    return (f"rank {rp.rank}: {kind} {int(r[i])} ({by.replace('dst_', '')} {int(g[i])}) "
            f"writes byte {int(lo[i])}, which {kind} {int(r[i - 1])} {where} writes too; "
            f"{FIX}")


def rank_violations(rp: RankPlan, header: PlanHeader) -> Iterator[str]:
    """Every check above, as the executor runs them at load (after `schemas.bounds`)."""
    yield from regions(rp)
    yield from roles(rp, peer_roles(header), None, header_staging(header))
    yield from sizes(rp, header.options.max_write_bytes, header.options.staging_bytes)
    yield from signals(rp)
    yield from packs(rp)
    yield from unpacks(rp)
    yield from shadow_violations(rp)  # a section's own rules (schemas/shadow.py)
