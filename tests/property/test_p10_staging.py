"""Property 10: no rank's staging exceeds what its ops use at peak (`options.staging_bytes`
is a cap, not an allocation).

What a rank's ops use, re-read from its plan here without `planner.tools.verify`: every staging
byte its writes read, its peers' writes land in, and its copies read or write (a QUANT's
e4m3 rows and its scales, `schemas.protocol.quant_scales`), per stage. Its staging must end
at the last of those bytes (rounded up to the compiler's 64-byte alignment), and be at
most what the `SLOTS` stages that use the most touch (a stage's use: from its first to its
last staging byte; the slot rotation keeps up to `SLOTS` stages live at once), plus the
alignment of each slot. `verify.staging_fit` must agree.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given

from planner.tools import verify
from schemas.plan import QUANT, Plan, RankPlan
from schemas.protocol import ITEM, SCALE_BYTES, SLOTS, quant_scales, staging_index, write_stages
from tests.property import harness
from tests.property.strategies import Case, cases

ALIGN = 64
"""Staging offsets the compiler aligns (`planner.passes.budget.ALIGN`)."""


def _box(rp: RankPlan, i: int, side: str) -> list[tuple[int, int]]:
    """Byte intervals, one per innermost run, of copy `i`'s box on `side`."""
    c = rp.copies
    es = int(ITEM[int(c[f"{side}_dtype"][i])])
    quant = int(c["kind"][i]) == QUANT
    n0, n1, n2 = (int(c[f"size{d}"][i]) for d in range(3))
    s0, s1, s2 = (int(c[f"{side}_stride{d}"][i]) for d in range(3))
    if quant:
        n2, s2 = 1, 1
        if side == "dst":
            s1 = 1
    dims = [(n, st) for n, st in ((n0, s0), (n1, s1), (n2, s2)) if n > 1]
    if any(n == 0 for n in (n0, n1, n2)):
        return []
    run = 1
    while dims and dims[-1][1] == run:  # the innermost dims that are contiguous
        run *= dims.pop()[0]
    starts = [int(c[f"{side}_offset"][i])]
    for n, st in dims:
        starts = [a + k * st for a in starts for k in range(n)]
    out = [(a * es, (a + run) * es) for a in starts]
    if quant and side == "dst":
        off, rb, cb, st = (int(v[0]) for v in quant_scales(rp, np.array([i])))
        out += [((off + r * st) * SCALE_BYTES, (off + r * st + cb) * SCALE_BYTES)
                for r in range(rb)]
    return out


def used(plan: Plan) -> dict[int, dict[int, list[tuple[int, int]]]]:
    """rank -> stage -> staging byte intervals its ops touch there."""
    out: dict[int, dict[int, list[tuple[int, int]]]] = {}
    sg = [staging_index(rp) for rp in plan.ranks]
    for rp in plan.ranks:
        w = rp.writes
        for i, s in enumerate(write_stages(rp).tolist()):
            n = int(w["nbytes"][i])
            if int(w["src_region"][i]) == sg[rp.rank]:
                lo = int(w["src_offset"][i])
                out.setdefault(rp.rank, {}).setdefault(s, []).append((lo, lo + n))
            d = int(w["dst_rank"][i])
            if int(w["dst_region"][i]) == sg[d]:
                lo = int(w["dst_offset"][i])
                out.setdefault(d, {}).setdefault(s, []).append((lo, lo + n))
        c = rp.copies
        for i in range(len(c)):
            for side in ("src", "dst"):
                if int(c[f"{side}_region"][i]) == sg[rp.rank]:
                    out.setdefault(rp.rank, {}).setdefault(int(c["stage"][i]), []).extend(
                        _box(rp, i, side))
    return out


@given(cases())
def test_no_rank_stages_more_than_its_ops_use_at_peak(case: Case) -> None:
    plan = harness.compile_case(case)
    use = used(plan)
    for rp in plan.ranks:
        sg = staging_index(rp)
        if sg < 0:
            assert rp.rank not in use
            continue
        have = rp.regions[sg].nbytes
        stages = use.get(rp.rank, {})
        end = max((hi for iv in stages.values() for _, hi in iv), default=0)
        assert have <= -(-end // ALIGN) * ALIGN, (rp.rank, have, end)
        spans = sorted((max(hi for _, hi in iv) - min(lo for lo, _ in iv)
                        for iv in stages.values()), reverse=True)
        assert have <= sum(spans[:SLOTS]) + SLOTS * ALIGN, (rp.rank, have, spans[:SLOTS])
    assert verify.staging_fit(plan) == []
