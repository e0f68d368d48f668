"""`budget`: each rank's staging budget from the cost model: sources the cap, targets the
write window (or fewer stages where boundaries would cost more than their share), never
above the cap, none without unpacks."""

from __future__ import annotations

import numpy as np

from planner.passes.budget import (
    BOUNDARY_SHARE,
    WINDOW_WRITES,
    boundary_s,
    budget_why,
    budgets,
    target_slot,
)
from schemas.config import Options
from schemas.protocol import SLOTS

MB = 1 << 20
OPTS = Options(staging_bytes=1 << 30)


def test_a_busy_target_holds_the_write_window_per_slot() -> None:
    # 40 GB in over 400 Gb/s: 0.8 s of ingress, boundaries are cheap: the window decides
    slot = target_slot(8 * MB, 4000 * MB, 40 * 10**9, OPTS, 400.0)
    assert int(slot) == WINDOW_WRITES * 8 * MB


def test_a_target_that_receives_little_keeps_it_in_one_stage() -> None:
    # 2 MB in: one boundary (14 us) is more than 5% of its 40 us ingress: one stage
    assert boundary_s(OPTS) > BOUNDARY_SHARE * 2e6 * 8 / 400e9
    assert int(target_slot(100_000, 1_500_000, 2_000_000, OPTS, 400.0)) == 1_500_032


def test_budgets_by_role() -> None:
    b = budgets(4, 2, np.array([2, 2]), np.array([8 * MB, 4 * MB]),
                np.array([0, 0, 40 * 10**9, 40 * 10**9]), OPTS, 400.0)
    assert b.tolist() == [1 << 30, 1 << 30, SLOTS * WINDOW_WRITES * 8 * MB, 0]
    capped = budgets(3, 2, np.array([2]), np.array([64 * MB]), np.array([0, 0, 10**11]),
                     Options(staging_bytes=256 * MB), 400.0)
    assert capped[2] == 256 * MB  # 3 x 4 x 64 MiB would exceed the cap


def test_why() -> None:
    assert budget_why("source", 0, 0, 0, OPTS, 400.0) == "source, up to the cap (1024 MiB)"
    assert budget_why("target", 0, 0, 10**9, OPTS, 400.0) == "target, direct writes only"
    assert "4 x its largest write (8.39 MB)" in budget_why("target", 8 * MB, 4000 * MB,
                                                           40 * 10**9, OPTS, 400.0)
    assert "(the cap)" in budget_why("target", 64 * MB, 4000 * MB, 40 * 10**9,
                                     Options(staging_bytes=256 * MB), 400.0)
