"""`schemas.protocol.Overlap` groups intervals by stage with one sort per table; it must
give, array for array, what the straightforward rule gives (a mask per stage, as it was
written first): on a many-stage compiled plan with packs, and on the fuzz base plans (FP8
QUANTs, whose scales are extra intervals; casts; unpacks from staging)."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.plan import PACK, QUANT, UNPACK, load_plan
from schemas.protocol import SLOTS, Overlap, copy_extents, overlaps, staging_index, write_stages
from tests.property import fuzz


def _reference(rp):
    """(prepacked, reads, packs) by the rule, one stage at a time."""
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    pre = np.zeros(rp.stages, dtype=bool)
    reads, packs = [empty] * rp.stages, [empty] * rp.stages
    sg, c = staging_index(rp), rp.copies
    if sg < 0 or rp.stages < 2 or not len(c):
        return pre, reads, packs
    w, w_stage = rp.writes, write_stages(rp)
    ok = (w_stage >= 0) & (w_stage < rp.stages) & (w["src_region"] == sg)
    unp = np.flatnonzero((c["kind"] == UNPACK) & (c["src_region"] == sg)
                         & (c["stage"] >= 0) & (c["stage"] < rp.stages))
    u_lo, u_hi = copy_extents(rp, "src", unp)
    for st in np.unique(np.concatenate([w_stage[ok], c["stage"][unp]])).tolist():
        sel, us = np.flatnonzero(ok & (w_stage == st)), c["stage"][unp] == st
        lo = w["src_offset"][sel].astype(np.int64)
        reads[st] = (np.concatenate([lo, u_lo[us]]),
                     np.concatenate([lo + w["nbytes"][sel], u_hi[us]]))
    packing = (c["kind"] == PACK) | (c["kind"] == QUANT)
    for st in np.unique(c["stage"][packing]).tolist():
        if st < 1 or st >= rp.stages:
            continue
        mine = np.flatnonzero(packing & (c["stage"] == st))
        packs[st] = copy_extents(rp, "dst", mine)
        if (c["src_region"][mine] == sg).any() or (c["dst_region"][mine] != sg).any():
            continue
        if any(overlaps(packs[st], reads[k]) for k in range(max(st - SLOTS + 1, 0), st)):
            continue
        pre[st] = True
    return pre, reads, packs


def _same(plan) -> int:
    early = 0
    for rp in plan.ranks:
        got, (pre, reads, packs) = Overlap(rp), _reference(rp)
        assert got.prepacked.tolist() == pre.tolist(), rp.rank
        for mine, ref in ((got.reads, reads), (got.packs, packs)):
            for (a, b), (x, y) in zip(mine, ref, strict=True):
                assert a.tolist() == x.tolist() and b.tolist() == y.tolist(), rp.rank
        early += int(pre.sum())
    return early


def test_overlap_on_a_many_stage_compile_is_the_rule():
    from planner.compiler import compile_layouts
    from planner.spec import spec_from_hf
    from tests.support.synthetic import SMALL_HF, fused_col_split, row_split, small_config

    spec = spec_from_hf(SMALL_HF)
    plan = compile_layouts(small_config(staging_bytes=8192, max_write_bytes=4096), spec,
                           row_split(spec, 3, "float32"), fused_col_split(spec, 2, 2))
    assert _same(plan) > 5


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, str]:
    return fuzz.base_plans(str(tmp_path_factory.mktemp("overlap")))


def test_overlap_on_the_fuzz_base_plans_is_the_rule(plans):
    for path in plans.values():
        _same(load_plan(path))
