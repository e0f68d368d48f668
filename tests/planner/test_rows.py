"""`planner/rows.py`: `unique_rows` equals `np.unique(axis=0)` (rows, first index,
inverse), including columns whose ranges overflow a single mixed-radix key."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from planner.rows import lexorder, row_keys, unique_rows

ints = st.integers(min_value=-(2 ** 62), max_value=2 ** 62)


@settings(max_examples=200, deadline=None)
@given(arrays(np.int64, st.tuples(st.integers(0, 40), st.integers(1, 6)),
              elements=st.one_of(st.integers(0, 3), ints)))
def test_equals_numpy(a: np.ndarray) -> None:
    want = np.unique(a, axis=0, return_index=True, return_inverse=True)
    got = unique_rows(a, return_index=True, return_inverse=True)
    assert np.array_equal(got[0], want[0])
    assert np.array_equal(got[1], want[1])
    assert np.array_equal(got[2], want[2].reshape(-1))


def test_wide_distinct_columns_rerank_instead_of_overflowing() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2 ** 40, size=(5000, 5))  # 5 columns of 5000 distinct values
    a = np.concatenate([a, a[::7]])
    keys = row_keys(a)
    order = np.lexsort(a.T[::-1])
    assert np.all(np.diff(keys[order]) >= 0)  # lexicographic order kept
    assert len(np.unique(keys)) == len(np.unique(a, axis=0))
    assert np.array_equal(unique_rows(a), np.unique(a, axis=0))


@settings(max_examples=200, deadline=None)
@given(arrays(np.int64, st.tuples(st.integers(1, 4), st.integers(0, 40)),
              elements=st.one_of(st.integers(0, 3), ints)))
def test_lexorder_equals_lexsort(keys: np.ndarray) -> None:
    assert np.array_equal(lexorder(*keys), np.lexsort(keys))
