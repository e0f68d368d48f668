"""Property 1: every logical element of every target replica is written exactly once per
run, and no two writes overlap in a destination.

Checked twice: by `planner.tools.verify.coverage` (what `rdma-plan verify` runs), and
independently of verify.py by `harness.write_counts`, which counts every byte the plan's
writes and unpacks touch and compares with the bytes the target layout's pieces cover
(1 on a piece, 0 on padding). Execution with labels (`test_p2_labels.py`) checks the same
from the other side: every element ends up holding its own label.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given

from planner.tools import verify
from tests.property import harness
from tests.property.strategies import Case, cases


@given(cases())
def test_every_target_byte_is_written_exactly_once(case: Case) -> None:
    plan = harness.compile_case(case)
    assert verify.bounds(plan) == []
    assert verify.coverage(plan) == []
    counts, problems = harness.write_counts(plan)
    assert problems == []
    covered = harness.covered_bytes(case)
    assert set(counts) == set(covered)
    for key, want in covered.items():
        got = counts[key]
        if not np.array_equal(got, want):
            i = int(np.argmax(got != want))
            raise AssertionError(f"rank {key[0]} region {key[1]}: byte {i} written "
                                 f"{got[i]} times, expected {want[i]}")
