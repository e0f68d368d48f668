"""`planner/rows.py`: `unique_rows` equals `np.unique(axis=0)` (rows, first index,
inverse), including columns whose ranges overflow a single mixed-radix key; `stable_argsort`
and `unique_sorted` equal numpy's stable argsort and `np.unique`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from planner.rows import (
    column_keys,
    distinct_rows,
    grouped_order,
    lexorder,
    lexorder_or_none,
    row_keys,
    stable_argsort,
    unique_rows,
    unique_sorted,
)

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


@settings(max_examples=200, deadline=None)
@given(arrays(np.int64, st.tuples(st.integers(1, 4), st.integers(0, 40)),
              elements=st.one_of(st.integers(0, 3), ints)))
def test_lexorder_or_none_is_none_only_for_rows_in_order(keys: np.ndarray) -> None:
    want = np.lexsort(keys)
    got = lexorder_or_none(*keys)
    if got is None:
        assert np.array_equal(want, np.arange(keys.shape[1]))
    else:
        assert np.array_equal(got, want)
    ordered = keys[:, want]
    assert lexorder_or_none(*ordered) is None  # in order: no permutation made


def test_stable_argsort_and_compaction_of_large_columns_keep_order() -> None:
    """Columns over `_BLOCK` rows: the row numbers and compacted keys made a block at a
    time."""
    rng = np.random.default_rng(3)
    n = (1 << 20) * 2 + 12345
    keys = np.stack([rng.integers(0, 5000, n), rng.integers(0, 3, n),
                     rng.integers(-(2 ** 40), 2 ** 40, n)])
    assert np.array_equal(lexorder(*keys), np.lexsort(keys))
    assert np.array_equal(stable_argsort(keys[0]), np.argsort(keys[0], kind="stable"))


@settings(max_examples=200, deadline=None)
@given(arrays(np.int64, st.tuples(st.integers(1, 5), st.integers(0, 40)),
              elements=st.one_of(st.integers(0, 3), ints)))
def test_grouped_order_is_lexsort_and_marks_equal_neighbours(cols: np.ndarray) -> None:
    *head, last = cols
    order, same = grouped_order(head, last)
    assert np.array_equal(order, np.lexsort([last, *head[::-1]]))
    rows = np.stack(head, axis=1)[order] if head else np.zeros((len(last), 0))
    want = np.zeros(len(last), dtype=bool)
    want[1:] = (rows[1:] == rows[:-1]).all(axis=1)
    assert np.array_equal(same, want)


def test_grouped_order_compacts_like_lexorder() -> None:
    """Narrow key columns whose spans multiply past int64, then byte offsets: the order is
    `np.lexsort`'s and `same` marks rows whose key columns equal the row's before."""
    rng = np.random.default_rng(4)
    n = 200_000
    head = [rng.integers(0, m, n).astype(np.int32) for m in (256, 45, 256, 181, 845)]
    head = [c[np.argsort(head[0], kind="stable")] for c in head]  # nearly sorted, as coalesce
    last = rng.integers(0, 1 << 31, n)
    order, same = grouped_order(head, last)
    assert np.array_equal(order, np.lexsort([last, *head[::-1]]))
    key = column_keys(head)[order]
    assert np.array_equal(same[1:], key[1:] == key[:-1]) and not same[0]


def test_grouped_order_by_sorted_pairs_marks_equal_neighbours(monkeypatch) -> None:
    """Rows in random order, enough of them for `stable_argsort`'s (key, row) pairs: the
    order is `np.lexsort`'s and `same` is read from the sorted pairs' keys (none of the
    rows' keys is held apart) a block at a time, equal to comparing the key columns row by
    row across the blocks' edges too."""
    from planner import rows as rows_mod

    monkeypatch.setattr(rows_mod, "_BLOCK", 997)
    rng = np.random.default_rng(7)
    n = 100_000
    head = [rng.integers(lo, lo + m, n).astype(np.int16) for lo, m in ((0, 40), (-5, 9), (3, 7))]
    last = rng.integers(0, 1 << 20, n)
    assert rows_mod._pairs(column_keys([*head, last])) not in (None, rows_mod._SORTED)  # pairs
    order, same = grouped_order(head, last)
    assert np.array_equal(order, np.lexsort([last, *head[::-1]]))
    rows = np.stack(head, axis=1)[order]
    assert np.array_equal(same[1:], (rows[1:] == rows[:-1]).all(axis=1)) and not same[0]
    assert same.sum() > n // 2  # (many equal neighbours, and blocks of rows cross them)


def test_compacted_keys_and_a_wide_last_column_keep_lexsort_order() -> None:
    """Narrow columns whose spans multiply past int64 (compacted by a table of the values
    present), then a wide last column (byte offsets: taken by value): `np.lexsort`'s order."""
    rng = np.random.default_rng(2)
    n = 200_000
    cols = [rng.integers(0, m, n) for m in (256, 45, 256, 181, 845, 30_000, 70_000)]
    cols.append(rng.integers(-2 ** 40, 2 ** 40, n))
    cols[-1][::3] = cols[-1][1::3][:len(cols[-1][::3])]  # equal offsets too
    for k in (len(cols), 4, 2):
        keys = cols[:k][::-1]
        assert np.array_equal(lexorder(*keys), np.lexsort(keys))
        a = np.stack(cols[:k], axis=1)
        want = np.unique(a, axis=0, return_index=True, return_inverse=True)
        got = unique_rows(a, return_index=True, return_inverse=True)
        assert all(np.array_equal(g, w.reshape(g.shape)) for g, w in zip(got, want))


def test_distinct_rows_by_table_and_by_sort_equal_numpy() -> None:
    """`distinct_rows` (no stacked copy; a table of the keys present where the columns'
    ranges multiply to a small span, else a sort) gives `np.unique(axis=0)`'s rows and
    dtype, for narrow, wide, negative, bool and huge-offset columns."""
    rng = np.random.default_rng(3)
    for trial in range(200):
        n = int(rng.integers(1, 2000))
        cols = []
        for _ in range(int(rng.integers(1, 5))):
            kind = int(rng.integers(0, 5))
            c = [rng.integers(0, 4, n), rng.integers(2 ** 62, 2 ** 62 + 9, n),
                 rng.integers(-2 ** 62, 2 ** 62, n), rng.integers(-5, 5, n).astype(np.int32),
                 rng.integers(0, 2, n).astype(bool)][kind]
            cols.append(c)
        want = np.unique(np.stack(cols, axis=1), axis=0)
        got = distinct_rows(cols)
        assert got.dtype == want.dtype and np.array_equal(got, want), trial
        assert np.array_equal(unique_rows(np.stack(cols, axis=1)), want), trial


def _keys(rng: np.random.Generator, n: int, lo: int, hi: int, dt: type) -> np.ndarray:
    return rng.integers(lo, hi, n, dtype=np.int64).astype(dt)


@pytest.mark.parametrize("n", [1, 1000, 40_000, 100_003])
@pytest.mark.parametrize("lo,hi,dt", [(0, 2, np.int64), (-5, 9, np.int32), (0, 200, np.uint8),
                                      (-(2 ** 40), 2 ** 40, np.int64),  # pairs fit
                                      (-(2 ** 62), 2 ** 62, np.int64),  # they do not: numpy's
                                      (0, 2 ** 63, np.uint64)])
def test_stable_argsort_and_unique_sorted_equal_numpy(n: int, lo: int, hi: int, dt: type
                                                      ) -> None:
    """Above the size where the (key, row) pairs are sorted, with ties and negative keys,
    and where the pairs would not fit (numpy's stable sort then)."""
    rng = np.random.default_rng(n)
    hi = min(hi, int(np.iinfo(dt).max))
    key = _keys(rng, n, lo, hi, dt) if dt != np.uint64 else rng.integers(
        0, 2 ** 63, n, dtype=np.uint64)
    key[::3] = key[0]  # ties: their rows must stay in order
    want = np.argsort(key, kind="stable")
    got = stable_argsort(key.copy())
    assert got.dtype == np.int64 and np.array_equal(got, want)
    owned = key.astype(np.int64) if dt != np.uint64 else None
    if owned is not None:
        assert np.array_equal(stable_argsort(owned, own=True), want)
    values, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    u_values, u_first, u_inverse = unique_sorted(key)
    assert np.array_equal(u_values, values) and u_values.dtype == values.dtype
    assert np.array_equal(u_first, first)
    assert np.array_equal(u_inverse, inverse.reshape(-1))


@pytest.mark.parametrize("run", [1 << 17, 1000, 70, 3])
def test_stable_argsort_of_sorted_runs_equals_numpy(run: int) -> None:
    """Columns sorted already, or in sorted runs long and short (numpy's merge sort, or the
    pairs), ties included."""
    rng = np.random.default_rng(run)
    key = np.concatenate([np.sort(rng.integers(0, 50, run)) for _ in range((1 << 17) // run)])
    assert np.array_equal(stable_argsort(key), np.argsort(key, kind="stable"))


def test_pair_sums_equal_per_pair_sums_over_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pair_sums`: rows and weights per (a, b) pair, as numpy's unbuffered sums give them,
    over several blocks (whole bytes near 2^40: exact in float64); None past `PAIR_BINS`."""
    import planner.rows as rows

    monkeypatch.setattr(rows, "_BLOCK", 1000)
    rng = np.random.default_rng(3)
    n, m = 37, 4321
    a, b = rng.integers(0, n, m).astype(np.int32), rng.integers(0, n, m).astype(np.int32)
    w = rng.integers(0, 1 << 40, m)
    count, total = np.zeros((n, n), np.int64), np.zeros((n, n), np.int64)
    np.add.at(count, (a, b), 1)
    np.add.at(total, (a, b), w)
    got = rows.pair_sums(a, b, w, n)
    assert got is not None
    assert got[0].dtype == np.int64 and (got[0] == count).all()
    assert (got[1] == total).all()
    empty = rows.pair_sums(a[:0], b[:0], w[:0], n)
    assert empty is not None and not empty[0].any() and not empty[1].any()
    monkeypatch.setattr(rows, "PAIR_BINS", n * n - 1)
    assert rows.pair_sums(a, b, w, n) is None
