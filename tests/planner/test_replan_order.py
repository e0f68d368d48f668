"""The replan's row order (`planner.rows.order_and_ties`): numpy's lexsort, stable, and
whether two rows are equal, whether the columns pack into one int64 key as they are, need
their rank among their values to, or fall back to a lexsort."""

from __future__ import annotations

import numpy as np
import pytest

from planner.rows import order_and_ties


@pytest.mark.parametrize("widths,distinct", [
    ((3, 10, 0, 29), 7),  # packs as it is
    ((6, 10, 40, 31), 7),  # packs once the widest column is ranked
    ((62, 62, 62, 62), 7),  # packs once every column is ranked
    ((40, 40, 40, 40, 40), 4000),  # too many values even ranked: a lexsort
])
@pytest.mark.parametrize("seed", [0, 1])
def test_lexorder_is_lexsort(widths, distinct, seed):
    rng = np.random.default_rng(seed)
    n = 5000
    cols = []
    for b in widths:  # values spread over `b` bits, some rows repeated
        values = rng.integers(0, 1 << b, distinct, dtype=np.int64) if b else np.zeros(
            1, np.int64)
        cols.append(values[rng.integers(0, len(values), n)] + (seed << 2))
    order, ties = order_and_ties(cols)
    want = np.lexsort(cols[::-1])
    assert np.array_equal(order, want)
    rows = np.stack(cols, 1)[want]
    assert ties == bool((rows[1:] == rows[:-1]).all(1).any())


def test_lexorder_without_ties_and_empty():
    cols = [np.array([2, 1, 2, 0]), np.array([5, 9, 4, 9])]
    order, ties = order_and_ties(cols)
    assert order.tolist() == [3, 1, 2, 0] and not ties
    order, ties = order_and_ties([np.zeros(0, np.int64)])
    assert len(order) == 0 and not ties
