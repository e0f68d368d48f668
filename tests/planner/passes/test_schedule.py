"""The stage DAG of `planner/passes/schedule.py`: acyclic by (stage, phase), proved without
networkx when every edge goes forward, and a cycle still found when one does not."""

from __future__ import annotations

import numpy as np
import pytest

from planner.passes import schedule
from planner.passes.schedule import PHASES, _dag, _forward
from schemas.plan import ACK, DONE, READY


def test_signals_go_forward() -> None:
    # 2 ranks, 3 stages: READY (0 -> 1), DONE of stage 1, and rank 1's ACK of stage 1
    # awaited by rank 0 in stage 2: every edge goes to a later (stage, phase).
    signals = np.array([[1, 0, 0, READY], [0, 1, 1, DONE], [1, 1, 0, ACK]])
    nodes, edges = _dag(3, 2, signals)
    assert len(nodes) == 2 * 3 * len(PHASES)
    assert _forward(edges, 3, len(PHASES))


def test_a_backward_edge_is_not_proved_and_a_cycle_is_found(monkeypatch) -> None:
    nph = len(PHASES)
    # node (rank 0, stage 1, phase 2) -> (rank 1, stage 0, phase 0): backward in time
    back = np.array([[1 * nph + 2, (1 * 2 + 0) * nph]])
    assert not _forward(back, 2, nph)
    assert _forward(back[:, ::-1], 2, nph)
    # an ACK awaited a stage before it is sent (a broken protocol rule) closes a cycle on
    # rank 0: (stage 0, write) -> ... -> (stage 1, ack) -> (stage 0, write)
    monkeypatch.setattr(schedule, "wait_stage", lambda kind, s: s - 1)
    with pytest.raises(RuntimeError, match="cycle"):
        _dag(2, 1, np.array([[0, 1, 0, ACK]]))
