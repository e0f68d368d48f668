"""Property 11: each rank's staging is within the budget the compiler chose for it
(`planner/passes/budget.py`): no rank stages more than `options.staging_bytes`; a target
stages only for its unpacks (none: no staging), at most `SLOTS` slots of `target_slot`
(the write window, or its boundary share) of what it unpacks and receives, re-read from
the plan: its UNPACK copies out of staging (their bytes and the largest) and its bytes in."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from planner.passes.budget import WINDOW_WRITES, target_slot
from schemas.plan import UNPACK
from schemas.protocol import ITEM, SLOTS, staging_index
from tests.property import harness
from tests.property.strategies import Case, cases

ALIGN = 64


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@given(cases(), st.booleans())
def test_every_rank_stages_within_its_budget(case: Case, slow_link: bool) -> None:
    if slow_link:  # the cases are small: on a slow link their boundaries are cheap, so
        # the write window, not the boundary share, sizes the targets' slots
        cluster = dataclasses.replace(case.cfg.cluster, nic_gbps=0.001)
        case = Case(case.spec, case.src, case.dst,
                    dataclasses.replace(case.cfg, cluster=cluster), case.hf)
    plan = harness.compile_case(case)
    cap = case.cfg.options.staging_bytes
    for rp in plan.ranks:
        sg = staging_index(rp)
        have = rp.regions[sg].nbytes if sg >= 0 else 0
        assert have <= cap, (rp.rank, have, cap)
        if plan.header.ranks[rp.rank].role != "target":
            continue
        c = rp.copies
        m = (c["kind"] == UNPACK) & (c["src_region"] == sg) if sg >= 0 else \
            np.zeros(len(c), dtype=bool)
        n = c["size0"][m] * c["size1"][m] * c["size2"][m] * ITEM[c["src_dtype"][m]]
        if not m.any():
            assert have == 0, (rp.rank, have)  # direct writes only
            continue
        budget = min(cap, SLOTS * int(target_slot(int(n.max()), int(n.sum()),
                                                   plan.header.rank_stats[rp.rank].bytes_in,
                                                   case.cfg.options, case.cfg.cluster.nic_gbps)))
        assert have <= budget, (rp.rank, have, budget)
        # and never more than the write window needs unless one stage takes all it unpacks
        assert have <= SLOTS * _align(max(WINDOW_WRITES * int(n.max()), int(n.sum())))
