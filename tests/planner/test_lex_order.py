"""`planner.rows.lexorder` (what `verify` sorts its runs by) is `np.lexsort`: the same
permutation on random integer columns, packed into one key where they fit and not where
they do not (values near +-2**62, negative ones, many ties); and
`schemas.table.among` is `np.isin` for a few values."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.rows import lexorder
from schemas.table import among

values = st.sampled_from([0, 1, 2, 3, 7, 1000, -1, -5, (1 << 40) + 3, (1 << 62) - 1,
                          -(1 << 62)])


@settings(deadline=None, max_examples=300)
@given(st.integers(1, 4).flatmap(
    lambda k: st.lists(st.tuples(*[values] * k), max_size=30)))
def test_lexorder_is_lexsort(rows):
    if not rows:
        assert len(lexorder(np.zeros(0, np.int64))) == 0
        return
    cols = [np.array(c, np.int64) for c in zip(*rows)]
    assert lexorder(*cols[::-1]).tolist() == np.lexsort(cols[::-1]).tolist()


def test_lexorder_packs_small_columns():
    rng = np.random.default_rng(3)
    cols = [rng.integers(-3, 9, 500), rng.integers(0, 4, 500), rng.integers(0, 1 << 30, 500)]
    assert lexorder(*cols[::-1]).tolist() == np.lexsort(cols[::-1]).tolist()


@settings(deadline=None, max_examples=200)
@given(st.lists(st.integers(-3, 300), max_size=40), st.lists(st.integers(-3, 300), max_size=5),
       st.sampled_from([np.int64, np.uint8, np.int32]))
def test_among_is_isin(items, values, dtype):
    a = np.array([x for x in items if dtype is not np.uint8 or 0 <= x < 256], dtype=dtype)
    assert among(a, tuple(values)).tolist() == np.isin(a, values).tolist()
