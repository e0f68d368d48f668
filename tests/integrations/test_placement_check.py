"""The backends' placement check (`integrations/placement_check.py`) on real placements: a
plan compiled for one placement is refused on an engine in another, in one line naming the
MoE layer, the slot and both experts; the same placement passes. vLLM's own EPLB maps are
read back in `tests/oracles/test_vllm_eplb_oracle.py`."""

from __future__ import annotations

import numpy as np
import pytest

from integrations import placement_check as pc
from integrations.errors import PlacementMismatchError
from schemas.placement import Placement


def _table(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([rng.permutation(np.r_[np.arange(8), [0, 3]]) for _ in range(4)])


def test_same_placement_passes_another_is_refused_in_one_line() -> None:
    a, b = Placement(_table(1)), Placement(_table(2))
    pc.check(a, a, "rdma_plan")
    with pytest.raises(PlacementMismatchError) as e:
        pc.check(b, a, "rdma_plan")
    layer, slot = (int(x) for x in np.argwhere(b.table != a.table)[0])
    line = str(e.value)
    assert "\n" not in line and f"MoE layer {layer} physical expert {slot}" in line
    assert f"holds logical expert {b.table[layer, slot]}" in line
    assert f"writes expert {a.table[layer, slot]}" in line and "nothing was written" in line


def test_plan_without_placement_on_a_moved_engine_is_refused() -> None:
    moved = Placement(np.array([np.roll(np.arange(8), 1)] * 4))
    with pytest.raises(PlacementMismatchError, match="default placement"):
        pc.check(moved, None, "rdma_plan")
    pc.check(Placement(np.array([np.arange(8)] * 4)), None, "rdma_plan")  # trivial: fine
    pc.check(None, None, "rdma_plan")
    with pytest.raises(PlacementMismatchError, match="without EPLB"):
        pc.check(None, moved, "rdma_plan")
    with pytest.raises(PlacementMismatchError, match="4 MoE layers x 10"):
        pc.check(Placement(_table(1)), moved, "rdma_plan")


def test_inverse_of_logical_to_physical_maps() -> None:
    table = _table(3)[0]
    l2p = np.full((8, 3), -1)
    count = np.zeros(8, np.int64)
    for slot, e in enumerate(table):
        l2p[e, count[e]] = slot
        count[e] += 1
    assert pc._inverse(l2p, count).tolist() == table.tolist()
