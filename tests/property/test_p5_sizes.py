"""Property 5: no write exceeds the max write size; coalescing never merges non-adjacent
ranges.

On compiled plans: every write is 1..max_write_bytes bytes (read off the plan directly,
and through `planner.tools.verify.sizes`). On the `coalesce` pass itself, with random writes:
the output moves exactly the same (source byte -> destination byte) pairs per (source
rank, stage, target rank, source region, target region) as the input, so a merge across
a gap on either side (which would move bytes nobody asked for, or skip some) fails; and
no output write is longer than `max_write_bytes`.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from planner.passes.coalesce import coalesce
from planner.passes.lower import Lowered
from planner.tools import verify
from schemas.plan import COPY_COLUMNS
from tests.property import harness
from tests.property.strategies import Case, cases

KEYS = ("w_src_rank", "w_stage", "w_dst_rank", "w_src_region", "w_dst_region")


@given(cases())
def test_no_write_exceeds_max_write_bytes(case: Case) -> None:
    plan = harness.compile_case(case)
    max_w = case.cfg.options.max_write_bytes
    for rp in plan.ranks:
        n = rp.writes["nbytes"]
        assert ((n >= 1) & (n <= max_w)).all(), (rp.rank, n.min(), n.max(), max_w)
    assert verify.sizes(plan) == []


@st.composite
def lowered_writes(draw: st.DrawFn) -> Lowered:
    """Writes of a few (src rank, stage, dst rank, src region, dst region) streams. In each
    stream, consecutive writes are adjacent on both sides, on one side only, or apart;
    destinations never overlap. The order is shuffled."""
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        key = [draw(st.integers(0, 1)) for _ in KEYS]
        so, do = draw(st.integers(0, 50)), draw(st.integers(0, 50))
        for _ in range(draw(st.integers(1, 12))):
            n = draw(st.integers(1, 3000))
            rows.append((*key, so, do, n))
            gap = draw(st.sampled_from(["both", "both", "src", "dst", "neither"]))
            so += n + (draw(st.integers(1, 9)) if gap in ("dst", "neither") else 0)
            do += n + (draw(st.integers(1, 9)) if gap in ("src", "neither") else 0)
    order = draw(st.permutations(range(len(rows))))
    a = np.array([rows[i] for i in order], dtype=np.int64).reshape(-1, 8)
    copies = {name: np.zeros(0, np.int64) for name, _ in COPY_COLUMNS}
    copies["rank"] = np.zeros(0, np.int64)
    return Lowered(w_src_rank=a[:, 0], w_src_region=a[:, 3], w_src_offset=a[:, 5],
                   w_dst_rank=a[:, 2], w_dst_region=a[:, 4], w_dst_offset=a[:, 6],
                   w_nbytes=a[:, 7], w_stage=a[:, 1], copies=copies,
                   staging=np.zeros(2, np.int64), stages=2)


def byte_pairs(low: Lowered) -> set[tuple[int, ...]]:
    out = set()
    for i in range(len(low.w_nbytes)):
        key = tuple(int(getattr(low, k)[i]) for k in KEYS)
        so, do = int(low.w_src_offset[i]), int(low.w_dst_offset[i])
        out.update((*key, so + b, do + b) for b in range(int(low.w_nbytes[i])))
    return out


@given(lowered_writes(), st.sampled_from([1, 7, 100, 4096, 1 << 20]))
def test_coalesce_merges_only_adjacent_runs(low: Lowered, max_write: int) -> None:
    out = coalesce(low, max_write)
    assert ((out.w_nbytes >= 1) & (out.w_nbytes <= max_write)).all()
    assert int(out.w_nbytes.sum()) == int(low.w_nbytes.sum())
    assert byte_pairs(out) == byte_pairs(low)


@given(lowered_writes(), st.sampled_from([1, 100, 1 << 20]))
def test_coalesce_of_a_held_table_equals_coalesce_of_it(low: Lowered, max_write: int) -> None:
    """Given in a list that holds the only reference (the compiler's way, so that the input
    columns go as the merged ones are made), `coalesce` empties the list and gives the same
    table as given `low` itself; the table it was given is left as it was."""
    copy = Lowered(**{k: getattr(low, k) for k in Lowered.__slots__})
    kept = {k: getattr(low, k).copy() for k in Lowered.__slots__ if k.startswith("w_")}
    held = [copy]
    del copy
    out, want = coalesce(held, max_write), coalesce(low, max_write)
    assert held == []
    for k in Lowered.__slots__:
        a, b = getattr(out, k), getattr(want, k)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), k
        elif k == "copies":
            assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
        else:
            assert a == b, k
    for k, v in kept.items():
        assert np.array_equal(getattr(low, k), v), k
