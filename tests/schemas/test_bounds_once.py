"""The bounds proof of a rank's copies runs once for ranks with equal inputs to it, and stays
a proof for every rank: a rank that differs from a proven one in any byte the proof reads
(its copies, its regions' sizes) is proven again and refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner.tools.verify import bounds
from schemas.bounds import violations
from schemas.plan import COPY_COLUMNS, QUANT, Region, Table, load_plan
from schemas.protocol import copy_footprint
from tests.property import fuzz


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return load_plan(fuzz.base_plans(str(tmp_path_factory.mktemp("once")))["fp8"])


def _quant_rank(plan):
    return next(rp for rp in plan.ranks if (rp.copies["kind"] == QUANT).any())


def _with_copy(rp, **values):
    i = int(np.flatnonzero(rp.copies["kind"] == QUANT)[0])
    cols = {n: np.array(rp.copies[n]) for n, _ in COPY_COLUMNS}
    for k, v in values.items():
        cols[k][i] = v
    return dataclasses.replace(rp, copies=Table.build(COPY_COLUMNS, **cols))


def test_a_twin_of_a_proven_rank_with_one_bad_copy_is_refused_by_name(plan):
    rp = _quant_rank(plan)
    assert next(violations(rp), None) is None  # proven, and remembered as proven
    assert next(violations(dataclasses.replace(rp, rank=rp.rank)), None) is None
    bad = _with_copy(rp, aux_offset=rp.regions[-1].nbytes // 4)
    msg = next(violations(bad), None)
    assert msg is not None and msg.startswith(f"rank {rp.rank}: copy op")
    assert "past the end of its dst region" in msg
    # the same bad copies again: still refused (a failed proof is never remembered)
    assert next(violations(bad), None) == msg


def test_equal_copies_over_smaller_regions_are_proven_again(plan):
    rp = _quant_rank(plan)
    assert next(violations(rp), None) is None
    staging = rp.regions[-1]
    _, reg, _, hi = copy_footprint(rp, "dst")
    n = int(hi[reg == len(rp.regions) - 1].max()) - 1  # one byte short of what they use
    small = dataclasses.replace(rp, regions=(*rp.regions[:-1],
                                             Region(staging.name, staging.dtype, (n,), n)))
    msgs = list(violations(small))  # (its writes from staging reach past it too)
    assert any(m.startswith(f"rank {rp.rank}: copy op") and "past the end of its dst region"
               in m for m in msgs)


def test_verify_names_the_one_bad_rank_among_proven_ones(plan):
    rp = _quant_rank(plan)
    assert bounds(plan) == []
    bad = _with_copy(rp, aux_offset=rp.regions[-1].nbytes // 4)
    ranks = tuple(bad if r is rp else r for r in plan.ranks)
    msgs = bounds(dataclasses.replace(plan, ranks=ranks))
    assert len(msgs) == 1 and msgs[0].startswith(f"rank {rp.rank}: copy op")
