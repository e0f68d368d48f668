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


def _order(sources: int, targets: int) -> np.ndarray:
    """The schedule's order of one stage where every source writes one 1 MiB write to every
    target: (source, target) of each write, in order."""
    from planner.passes.lower import Lowered
    from planner.topology import Topology

    src = np.repeat(np.arange(sources), targets)
    dst = np.tile(np.arange(targets), sources) + sources
    n, world = len(src), sources + targets
    zero = np.zeros(n, dtype=np.int64)
    low = Lowered(src, zero, zero, dst, zero + 1, zero, zero + (1 << 20), zero, copies={},
                  staging=np.zeros(world, dtype=np.int64), stages=1)
    topo = Topology(sources, targets, tuple(range(world)), (0,) * world, tuple(range(world)),
                    1, 400.0, 3600.0, world)
    sch = schedule.schedule(low, topo, 64 << 20, np.ones(world, dtype=np.int64))
    return np.stack([src[sch.order], dst[sch.order]], axis=1)


@pytest.mark.parametrize("sources, targets", [(256, 128), (64, 128), (96, 96), (12, 5)])
def test_sources_feeding_one_target_reach_it_spread_over_the_stage(sources: int,
                                                                   targets: int) -> None:
    """Each source visits every target once; a run of consecutive sources (the quarter of
    them with the highest ranks: FSDP2's ranks that hold no expert, each owning gathered
    boxes) reaches each target at positions spread over the whole pass, never all in one
    half of it (a rotation by the source rank alone put them all in one part of it)."""
    order = _order(sources, targets)
    pos = np.empty((sources, targets), dtype=np.int64)  # when source s reaches target t
    pos[order[:, 0], order[:, 1] - sources] = np.tile(np.arange(targets), sources)
    run = pos[sources - max(sources // 4, 3):]
    for t in range(targets):
        seen = np.sort(run[:, t])
        gaps = np.diff(np.r_[seen, seen[0] + targets])
        assert gaps.max() <= max(3 * targets // len(run), targets // 2), (t, seen)
    # at any position the sources are at different targets (where there are enough)
    for p in range(targets):
        at = np.flatnonzero(pos == p)  # flat (source, target) indices
        counts = np.bincount(at % targets, minlength=targets)
        assert counts.max() <= -(-sources // targets)


def test_spread_is_coprime_with_the_targets() -> None:
    for n in range(1, 600):
        k = schedule.spread(n)
        assert np.gcd(k, n) == 1 and 0 < k <= n or n == 1
