"""`planner/passes/staging.py`: the vectorised first fit gives what placing the staged
chunks one at a time gives (`tests/support/staging_ref.py`), on random tables with packs
only, unpacks only and chunks that use both ranks; and a worked example."""

from __future__ import annotations

import numpy as np
import pytest

from planner.passes.staging import QUANTUM, place_staging, staging_order
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


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("step", [0, 1, 7, -9, 40])
def test_order_of_alike_blocks(seed: int, step: int) -> None:
    # `copies` alike blocks (block k's target ranks the first's plus k * step) are placed as
    # the whole table of them is: by runs made once where the blocks' targets are apart
    # (step 40, -9 here), by the whole table where they are not
    rng = np.random.default_rng(seed)
    copies, n, world = 2 + seed % 3, 300 + 40 * seed, 200
    src = rng.integers(0, 20, n).astype(np.int32)
    dst = rng.integers(100, 108, n).astype(np.int32)
    nbytes = rng.integers(1, 40, n) * (QUANTUM // 8)
    d = np.concatenate([dst + k * step for k in range(copies)])
    want, none = staging_order(np.tile(src, copies), d, np.tile(nbytes, copies), world)
    assert none is None
    row, block = staging_order(src, dst, nbytes, world, copies, step)
    assert block is not None and block.dtype == np.int32
    assert np.array_equal(block.astype(np.int64) * n + row, want)
    assert len(np.unique(want)) == copies * n


def test_columns_in_placement_order() -> None:
    # si None: the columns are already in placement order; the same as taking them by si
    src, dst, pack, unpack, nbytes, budget, world = _case(5, 500, 4, 3, 0.3, 6000)
    si = np.random.default_rng(1).permutation(len(src))
    opts = Options(staging_bytes=int(budget.max()))
    by_si = place_staging(si, src, dst, pack, unpack, nbytes, budget, opts,
                          np.zeros(len(src), dtype=np.int64), ["t"], world, 1)
    placed = place_staging(None, src[si], dst[si], pack[si], unpack[si], nbytes[si], budget,
                           opts, np.zeros(len(src), dtype=np.int64), ["t"], world, 1)
    for g, w in zip(by_si[:4], placed[:4]):
        assert np.array_equal(g, w)
    assert by_si[4] == placed[4]
