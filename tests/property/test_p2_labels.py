"""Property 2: the source bytes of every write hold the same logical elements as its
destination bytes (through packs, casts and unpacks).

Checked by execution, independently of verify.py: the logical tensors are "labels" (each
element's value names it; see `harness`), the sources are materialized from them, every
target element starts at `SENTINEL`, and `executor.run_all_local` replays the plan twice
(staging is reused between steps). Afterwards every element a target piece covers holds
its own label (after the cast to the target dtype) and every padding element is still
`SENTINEL`. With float32 on both sides the labels are unique per logical element.
Block-FP8 targets change values by design; property 8 checks them against the reference
quantizer.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.property import harness
from tests.property.strategies import Case, cases


@given(st.one_of(cases("float32", "float32"), cases(fp8=False)))
def test_every_target_element_holds_its_own_label(case: Case) -> None:
    plan = harness.compile_case(case)
    full = harness.labels(case)
    got = harness.run(plan, case, full, steps=2)
    assert harness.mismatches(got, harness.expected(case, full)) == []
