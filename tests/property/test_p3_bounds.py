"""Property 3: every op is inside its regions' bounds; staging never exceeds the budget.

Checked by `planner.tools.verify.bounds` and `verify.sizes` (the staging part), by the
executor's own load-time check (`executor.check.check_rank_plan`, a second
implementation), and directly: every staging region is at most `options.staging_bytes`.
"""

from __future__ import annotations

from hypothesis import given

from executor.check import check_rank_plan
from planner.tools import verify
from schemas.plan import STAGING
from tests.property import harness
from tests.property.strategies import Case, cases


@given(cases())
def test_ops_stay_in_bounds_and_staging_in_budget(case: Case) -> None:
    plan = harness.compile_case(case)
    assert verify.bounds(plan) == []
    for rp in plan.ranks:
        check_rank_plan(rp)  # raises PlanBoundsError
    budget = case.cfg.options.staging_bytes
    staging = {rp.rank: r.nbytes for rp in plan.ranks for r in rp.regions if r.name == STAGING}
    assert all(n <= budget for n in staging.values()), (budget, staging)
    assert [p for p in verify.sizes(plan) if "staging" in p] == []
