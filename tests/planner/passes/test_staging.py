"""`planner/passes/staging.py`: the vectorised first fit gives what placing the staged
chunks one at a time gives (`tests/support/staging_ref.py`), on random tables with packs
only, unpacks only and chunks that use both ranks; and a worked example."""

from __future__ import annotations

import numpy as np
import pytest

from planner.passes.staging import place_staging
from schemas.config import Options
from tests.support.staging_ref import place_staging_loop


def _case(seed: int, n: int, sources: int, targets: int, both_share: float,
          budget_max: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    world = sources + targets
    src = rng.integers(0, sources, n)
    dst = rng.integers(sources, world, n)
    kind = rng.random(n)
    pack = kind < 0.5 + both_share / 2
    unpack = kind >= 0.5 - both_share / 2
    nbytes = rng.integers(1, budget_max // 3, n) * rng.choice([1, 7, 64], n)
    budget = rng.integers(budget_max // 2, budget_max, world)
    budget = np.maximum(budget, nbytes.max())  # every chunk fits an empty stage
    if seed % 3 == 0:  # some budgets too small for slots: whole-budget stages
        budget[rng.integers(0, world)] = nbytes.max()
    return src, dst, pack, unpack, nbytes, budget, world


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("both_share", [0.0, 0.3, 1.0])
def test_equals_the_loop(seed: int, both_share: float) -> None:
    src, dst, pack, unpack, nbytes, budget, world = _case(
        seed, n=400 + 50 * seed, sources=3 + seed % 4, targets=2 + seed % 5,
        both_share=both_share, budget_max=6000)
    si = np.random.default_rng(seed + 99).permutation(len(src))[: len(src) - seed]
    first = seed % 2
    opts = Options(staging_bytes=int(budget.max()))
    got = place_staging(si, src, dst, pack, unpack, nbytes, budget, opts,
                        np.zeros(len(src), dtype=np.int64), ["t"], world, first)
    want = place_staging_loop(si, src, dst, pack, unpack, nbytes, budget, world, first)
    for name, g, w in zip(("stage", "s_off", "d_off", "staging"), got[:4], want[:4]):
        assert np.array_equal(g, w), name
    assert got[4] == want[4]
    assert got[0].max() > first + 2  # the case is not trivial: several stages


def test_worked_example() -> None:
    # Ranks 0 (source) and 1 (target), budgets 3 x 192 (slots of 192 bytes). Chunks in
    # order: A packs 100 bytes on 0 (stage 0, offset 0; next offset aligned: 128);
    # B packs 64 on 0 (128 + 64 = 192 fits: offset 128); C packs 10 on 0 and unpacks on 1:
    # 0 is full (192 + 10 > 192), so stage 1 on both, offset 0 on each; D unpacks 150 on 1:
    # 64 + 150 > 192, so stage 2. Slot k of a rank starts where slot k-1 ends (aligned).
    src = np.array([0, 0, 0, 0])
    dst = np.array([1, 1, 1, 1])
    pack = np.array([True, True, True, False])
    unpack = np.array([False, False, True, True])
    nbytes = np.array([100, 64, 10, 150])
    budget = np.array([576, 576])
    stage, s_off, d_off, staging, slots = place_staging(
        np.arange(4), src, dst, pack, unpack, nbytes, budget, Options(staging_bytes=576),
        np.zeros(4, dtype=np.int64), ["t"], 2)
    assert slots
    assert stage.tolist() == [0, 0, 1, 2]
    assert s_off.tolist() == [0, 128, 192, 0]  # rank 0: slot 0 is 192 bytes, slot 1 at 192
    assert d_off.tolist() == [0, 0, 0, 64]  # rank 1: slot 1 (10 bytes) at 0, slot 2 at 64
    assert staging.tolist() == [202, 214]
