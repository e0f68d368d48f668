"""Property 4: the DAG is acyclic; each write comes after the packs (and casts) it needs
and before its notification; unpacks come after the writes they read.

Checked by `planner.tools.verify.order` (acyclic stage DAG; every wait matched by a signal and
vice versa; READY before and DONE after every (source, target, stage) with writes; ACK
before reusing a target's staging) and `verify.dataflow` (every staging byte a write reads
is packed in the write's stage; every staging byte an unpack reads is written in the
unpack's stage; packs of a stage never overlap). The protocol of `schemas/plan.py` runs
packs, then writes, then DONE, then unpacks within a stage, so these make the order right.
"""

from __future__ import annotations

from hypothesis import given

from planner.tools import verify
from tests.property import harness
from tests.property.strategies import Case, cases


@given(cases())
def test_writes_follow_their_packs_and_precede_their_notifications(case: Case) -> None:
    plan = harness.compile_case(case)
    assert verify.bounds(plan) == []
    assert verify.order(plan) == []
    assert verify.dataflow(plan) == []
