"""The `_by_group` interval functions (`schemas/intervals.py`) answer for every group at once
what asking each group alone answers: checked against byte sets, group by group, on random
intervals (empty ones, touching ones, offsets near 2**60, groups far apart), by both of the
key maps beneath them (the direct one where the numbers allow, the sorted one else)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import schemas.intervals as intervals
from schemas.intervals import first_overlap_by_group, outside_by_group, overlap_by_group
from schemas.runs import first_overlap

BIG = 1 << 60

interval = st.tuples(st.sampled_from([0, 1, 5, 9000, 1 << 14]),
                     st.integers(0, 40), st.integers(0, 12), st.booleans())


def _cols(items):
    """(group, lo, hi) columns of `(group, lo, length, far)` items (far: near 2**60)."""
    g = np.array([i[0] for i in items], np.int64)
    lo = np.array([i[1] + (BIG - 64 if i[3] else 0) for i in items], np.int64)
    return g, lo, lo + np.array([i[2] for i in items], np.int64)


def _cover(lo, hi) -> set[int]:
    out: set[int] = set()
    for a, z in zip(lo.tolist(), hi.tolist()):
        out.update(range(a, z))
    return out


@settings(deadline=None, max_examples=300)
@given(st.lists(interval, max_size=14), st.lists(interval, max_size=14))
def test_by_group_is_each_group_alone(a_items, b_items):
    direct = intervals._direct
    try:
        for form in (direct, lambda parts: None):  # the direct map, then the sorted one
            intervals._direct = form
            _each_group_alone(a_items, b_items)
    finally:
        intervals._direct = direct


def _each_group_alone(a_items, b_items):
    ag, alo, ahi = _cols(a_items)
    bg, blo, bhi = _cols(b_items)
    out = outside_by_group(ag, alo, ahi, bg, blo, bhi)
    hit = overlap_by_group(ag, alo, ahi, bg, blo, bhi)
    for i in range(len(ag)):
        mine = bg == ag[i]
        covered = _cover(blo[mine], bhi[mine])
        read = set(range(int(alo[i]), int(ahi[i])))
        assert bool(out[i]) == (bool(read) and not read <= covered)
        assert bool(hit[i]) == bool(read & covered)
    groups = first_overlap_by_group(ag, alo, ahi).tolist()
    want = [g for g in np.unique(ag).tolist()
            if first_overlap(alo[ag == g], ahi[ag == g]) is not None]
    assert groups == want
