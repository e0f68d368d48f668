"""What the plan writes into a target rank, as the shadow section states it (`schemas/shadow.py`).

`written` is the one definition of "the byte ranges the plan writes" on a rank: the peers'
writes that land in its bound tensors and its own UNPACKs into them, one run per contiguous
byte run, merged. The compiler's shadow pass (`planner/passes/shadow.py`) states it in the
plan; `rdma-plan verify` (`shadow` check) recomputes it from the peers' parts and compares,
after the rank-local rules the executor also runs at load (`schemas.shadow`).
"""

from __future__ import annotations

import numpy as np

from planner.verify_rank import Incoming, copy_runs
from schemas.intervals import union
from schemas.plan import UNPACK, RankPlan
from schemas.protocol import staging_index
from schemas.shadow import shadow_violations

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


def rank_shadow(rp: RankPlan, inc: Incoming) -> list[str]:
    """Violations of `rp`'s shadow section: its own rules, then its regions against what
    the plan writes into the rank (no section: none)."""
    if rp.shadow is None:
        return []
    msgs = list(shadow_violations(rp))[:1]
    if msgs:
        return msgs
    region, off, n = written(rp, inc)
    g = rp.shadow.regions
    same = len(region) == len(g) and bool(
        (g["region"] == region).all() and (g["offset"] == off).all()
        and (g["nbytes"] == n).all())
    if same:
        return []
    return [f"rank {rp.rank}: its shadow regions ({len(g)} runs, {int(g['nbytes'].sum())} "
            f"bytes) are not the bytes the plan writes into it ({len(region)} runs, "
            f"{int(n.sum())} bytes); the plan is corrupt or was tampered with: recompile it"]
