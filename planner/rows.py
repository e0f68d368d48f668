"""`unique_rows` and `lexorder`: `np.unique(a, axis=0)` and `np.lexsort` for integer tables,
without numpy's structured or multi-pass sorts.

numpy's row-wise unique views each row as one opaque item and sorts those (slow on the
compiler's tables of millions of rows). Here every column is replaced
by its rank among the column's distinct values, and the ranks are combined into one int64
key column by column in mixed radix (re-ranked whenever the next column would overflow:
by a table of the values present while their range is small, not a sort);
the key's order is the rows' lexicographic order, so the results equal numpy's: the
unique rows in sorted order, the index of each one's first occurrence, and the inverse.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_LIMIT = np.iinfo(np.int64).max
_INT32 = np.iinfo(np.int32).max


def _range(col: np.ndarray) -> tuple[int, int] | None:
    """(minimum, number of values from it to the maximum) of an integer column, else None."""
    if not len(col) or col.dtype.kind not in "iub":
        return None
    lo = int(col.min())
    return lo, int(col.max()) - lo + 1


def _ranks(col: np.ndarray) -> tuple[np.ndarray, int]:
    """Each value's rank among the column's distinct values, and their number (a sort)."""
    values, _, codes = unique_sorted(col)
    return codes, len(values)


def unique_sorted(key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`np.unique(key, return_index=True, return_inverse=True)` of an integer column, the
    indices as int64: its distinct values sorted, each one's first row, and each row's
    value's index among them; by one `stable_argsort`."""
    key = np.asarray(key).reshape(-1)
    n = len(key)
    if n == 0 or key.dtype.kind not in "iu":
        values, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        return values, first.astype(np.int64), inverse.reshape(-1).astype(np.int64)
    order = stable_argsort(key)
    ordered = key[order]
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
    values = ordered[new]
    del ordered
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = np.cumsum(new, dtype=np.int64) - 1
    return values, order[new], inverse


def _compact(key: np.ndarray, span: int) -> tuple[np.ndarray, int]:
    """`key` (in [0, span)) as ranks among its distinct values: by a table of the values
    present when `span` is at most four times the rows (or 2^17; no sort), else `_ranks`."""
    if span > max(4 * len(key), 1 << 17):
        return _ranks(key)
    seen = np.zeros(span, dtype=bool)
    seen[key] = True
    rank = np.cumsum(seen, dtype=np.int32 if span < 1 << 31 else np.int64)
    del seen
    m = int(rank[-1])
    rank -= 1
    if key.dtype != np.int64 or not key.flags.writeable:
        return rank[key].astype(np.int64), m
    for lo in range(0, len(key), _BLOCK):  # in place, a block at a time: no second key
        part = key[lo:lo + _BLOCK]
        part[:] = rank[part]
    return key, m


def row_keys(a: np.ndarray) -> np.ndarray:
    """One int64 per row of the 2-d integer array `a`, ordered as the rows are
    lexicographically (equal rows, equal keys)."""
    n, k = a.shape
    if k == 0 or n == 0:
        return np.zeros(n, dtype=np.int64)
    return column_keys([a[:, j] for j in range(k)])


def column_keys(cols: Sequence[np.ndarray]) -> np.ndarray:
    """`row_keys(np.stack(cols, axis=1))`, without making the stacked copy. Each column is
    coded by its value less its minimum where its range is small (else ranked: a sort) and
    the codes combined in mixed radix; the key so far is compacted to ranks of its distinct
    values (`_compact`, by a table while its range is small) where the columns left would
    overflow it. A wide last column (byte offsets) is taken by value when it fits after
    that compaction: no sort."""
    return _column_keys(cols)[0]


def _column_keys(cols: Sequence[np.ndarray], prefix: bool = False
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """`column_keys`, and with `prefix` a key of the columns but the last (equal rows of
    those, equal keys): the key as it stands before the last column joins it."""
    key, before, _ = _keys(cols, prefix)
    return key, before


def _keys(cols: Sequence[np.ndarray], prefix: bool = False
          ) -> tuple[np.ndarray, np.ndarray | None, int]:
    """`_column_keys`, and the span `m` the last column joins the key with: the key is the
    key of the columns but the last (`prefix`'s, where asked) times `m`, plus the last
    column's code (in [0, m)), so the key floor-divided by `m` is that prefix."""
    cols = [np.asarray(c).reshape(-1) for c in cols]
    if not cols or len(cols[0]) == 0:
        n = len(cols[0]) if cols else 0
        return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int32) if prefix else None, 1
    n = len(cols[0])
    small, table = max(n, 1 << 16), max(4 * n, 1 << 17)
    ranges = [_range(c) for c in cols]
    rest = [1] * (len(cols) + 1)  # an upper bound of the span of columns i.. (capped)
    for i in range(len(cols) - 1, -1, -1):
        r = ranges[i]
        m = r[1] if r is not None and (r[1] < small or i == len(cols) - 1) else n
        rest[i] = min(rest[i + 1] * m, _LIMIT + 1)
    key, span, before = np.zeros(0, dtype=np.int64), 1, None
    for i, (col, r) in enumerate(zip(cols, ranges)):
        last = i == len(cols) - 1
        wide = r is None or r[1] >= small
        if i and last and r is not None and wide and span > _LIMIT // r[1]:
            key, span = _compact(key, span)  # the column's values may then fit as they are
        lo = 0  # codes: the column less `lo` (in place, no copy), or its ranks
        if wide and not (last and r is not None and span <= _LIMIT // r[1]):
            codes, m = _ranks(col)
        else:
            assert r is not None
            (lo, m), codes = r, col if col.dtype.itemsize < 8 else \
                col.astype(np.int64, copy=False)  # (read only: no copy of an int64 column)
        if i == 0:
            key, span = codes.astype(np.int64, copy=codes is col), m
            key -= lo
            if prefix and last:
                before = np.zeros(n, dtype=np.int32)
            continue
        if span > _LIMIT // m or (span <= table < span * m and span * rest[i] > _LIMIT):
            key, span = _compact(key, span)  # now: later it may need a sort
        if prefix and last:  # as int32 where it fits: held beside the whole key's sort
            before = key.astype(np.int32 if span <= _INT32 else np.int64)
        _append(key, codes, lo, m)
        span *= m
    return key, before, m


def _append(key: np.ndarray, codes: np.ndarray, lo: int, m: int) -> None:
    """`key = key * m + (codes - lo)` in place, in the order that keeps every partial sum
    within int64."""
    key *= m
    if lo > 0:
        key -= lo
    key += codes
    if lo < 0:
        key -= lo


def unique_columns(cols: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(np.stack(cols, axis=1), axis=0, return_index=True, return_inverse=True)`
    less the unique rows themselves: (index of each unique row's first occurrence, in the
    rows' sorted order; the unique row of each row)."""
    _, first, inverse = unique_sorted(column_keys(cols))
    return first, inverse


def lexorder(*keys: np.ndarray) -> np.ndarray:
    """`np.lexsort(keys)` (the last key primary, stable) for integer keys, by one stable
    argsort of a combined key."""
    if not keys or len(keys[0]) == 0:
        return np.zeros(len(keys[0]) if keys else 0, dtype=np.int64)
    return stable_argsort(column_keys(keys[::-1]), own=True)  # (no stacked copy)


def lexorder_or_none(*keys: np.ndarray) -> np.ndarray | None:
    """`lexorder(*keys)`, or None where the rows are in that order already (no
    permutation made)."""
    if not keys or len(keys[0]) < 2:
        return None
    key = column_keys(keys[::-1])
    if not (key[1:] < key[:-1]).any():
        return None
    return stable_argsort(key, own=True)


def grouped_order(cols: Sequence[np.ndarray], last: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """`lexorder(last, *cols[::-1])` (rows by `cols`, then by `last`; stable) and, in that
    order, whether each row's `cols` equal the row's before it (False for the first row):
    the key of all the columns is made once for both, and `same` read from it in sorted
    order a block at a time (that key floor-divided by the last column's span is the key
    of `cols`: no second key held beside the sort)."""
    full, _, m = _keys([*cols, last])
    n, fit = len(full), _pairs(full)
    if fit is None or fit == _SORTED:  # numpy's sort (or none): `full` left as it is
        order = np.arange(n, dtype=np.int64) if fit == _SORTED else \
            np.argsort(full, kind="stable").astype(np.int64, copy=False)
        keys = (full[order[at:at + _BLOCK]] for at in range(0, n, _BLOCK))
    else:  # `stable_argsort`'s pairs in `full`'s buffer: their keys read, then the rows kept
        lo, bits = fit
        order = _sorted_pairs(full, lo, bits)
        keys = (_pair_keys(order[at:at + _BLOCK], lo, bits) for at in range(0, n, _BLOCK))
    same = np.zeros(n, dtype=bool)
    prev = None
    for at, part in zip(range(0, n, _BLOCK), keys):
        part //= m  # (a new array: the block's keys of `cols`)
        np.equal(part[1:], part[:-1], out=same[at + 1:at + len(part)])
        if prev is not None:
            same[at] = part[0] == prev
        prev = part[-1]
    if fit is not None and fit != _SORTED:
        order &= (1 << fit[1]) - 1
    return order, same


def _pair_keys(pairs: np.ndarray, lo: int, bits: int) -> np.ndarray:
    """The keys of sorted (key, row) pairs (`_sorted_pairs`), as a new array."""
    out = pairs >> bits
    if lo:
        out += lo
    return out


def stable_argsort(key: np.ndarray, own: bool = False) -> np.ndarray:
    """`np.argsort(key, kind="stable")` of an integer column, as int64: where each key less
    the least, shifted left by the bits of a row number, leaves room for the row number in
    an int64, those (key, row) pairs as one int64 each, sorted (not stably: they are all
    distinct) and masked back to the row numbers (numpy's stable sort of int64 is a merge
    sort, several times slower than its sort on random keys); else, and where the column
    is in long sorted runs already (which the merge sort takes whole), numpy's. `own`: `key`
    may be overwritten (its buffer becomes the result)."""
    fit = _pairs(key)
    if fit == _SORTED:
        return np.arange(len(key), dtype=np.int64)
    if fit is None:
        return np.argsort(key, kind="stable").astype(np.int64, copy=False)
    lo, bits = fit
    pair = _sorted_pairs(key if own and key.dtype == np.int64 else key.astype(np.int64),
                         lo, bits)
    pair &= (1 << bits) - 1
    return pair


def _pairs(key: np.ndarray) -> tuple[int, int] | None:
    """(least key, bits of a row number) where `stable_argsort` sorts `key` as (key, row)
    pairs; `_SORTED` where the column is in order already; None where the sort is
    numpy's."""
    n = len(key)
    if n < _SMALL or key.dtype.kind not in "iu" or key.dtype.itemsize > 8:
        return None
    descents = int(np.count_nonzero(key[1:] < key[:-1]))
    if descents == 0:
        return _SORTED
    if descents * _RUN < n:  # long sorted runs: numpy's merge sort takes them as they are
        return None
    lo, hi = int(key.min()), int(key.max())
    bits = (n - 1).bit_length()
    if (hi - lo).bit_length() + bits > 63:
        return None
    return lo, bits


_SORTED = (-1, -1)
"""`_pairs`' answer for a column in order already (`stable_argsort`: no sort)."""


def _sorted_pairs(pair: np.ndarray, lo: int, bits: int) -> np.ndarray:
    """The int64 keys `pair` (overwritten) as (key - `lo`, row) pairs in one int64 each,
    sorted."""
    if lo:
        pair -= lo
    pair <<= bits
    for at in range(0, len(pair), _BLOCK):  # the row numbers, a block at a time
        pair[at:at + _BLOCK] |= np.arange(at, min(at + _BLOCK, len(pair)), dtype=np.int64)
    pair.sort()
    return pair


_BLOCK = 1 << 20
"""Rows a whole-column step works on at a time where a temporary as long as the column
is not wanted."""
_SMALL = 1 << 15
"""Rows below which `stable_argsort` is numpy's (its pairs only pay on large columns)."""
_RUN = 64
"""Mean length of a column's sorted runs from which `stable_argsort` is numpy's."""


def unique_rows(a: np.ndarray, return_index: bool = False,
                return_inverse: bool = False) -> np.ndarray | tuple[np.ndarray, ...]:
    """`np.unique(a, axis=0, return_index=..., return_inverse=...)` for a 2-d int array."""
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError("unique_rows takes a 2-d array")
    if not return_index and not return_inverse:
        return distinct_rows([a[:, j] for j in range(a.shape[1])]).astype(a.dtype, copy=False)
    _, first, inverse = unique_sorted(row_keys(a))
    out = [a[first]]
    if return_index:
        out.append(first)
    if return_inverse:
        out.append(inverse.reshape(-1))
    return out[0] if len(out) == 1 else tuple(out)


def distinct_rows(cols: Sequence[np.ndarray]) -> np.ndarray:
    """`unique_rows(np.stack(cols, axis=1))`: the distinct rows, sorted, as a 2-d array of
    the columns' common dtype, without the stacked copy; and where the columns' ranges
    multiply to at most four times the rows, without a sort: the rows' keys in mixed radix
    mark a table of the keys present, whose marks, in order, decode to the rows."""
    cols = [np.asarray(c).reshape(-1) for c in cols]
    dt = np.result_type(*cols) if cols else np.dtype(np.int64)
    n = len(cols[0]) if cols else 0
    if n == 0:
        return np.zeros((0, len(cols)), dtype=dt)
    ranges = [_range(c) for c in cols]
    span = 1
    for r in ranges:  # `_range` is None for a column that is not integers
        span = _LIMIT if r is None else min(span * r[1], _LIMIT)
    if span > max(4 * n, 1 << 17):
        _, first, _ = unique_sorted(column_keys(cols))
        return np.stack([c[first] for c in cols], axis=1).astype(dt)
    key = np.zeros(n, dtype=np.int64)
    for c, (lo, m) in zip(cols, ranges):  # type: ignore[misc]
        _append(key, c if c.dtype.kind != "u" or c.dtype.itemsize < 8 else c.astype(np.int64),
                lo, m)
    seen = np.zeros(span, dtype=bool)
    seen[key] = True
    del key
    at = np.flatnonzero(seen)
    out = np.empty((len(at), len(cols)), dtype=dt)
    for j in range(len(cols) - 1, -1, -1):
        lo, m = ranges[j]
        at, code = np.divmod(at, m)
        out[:, j] = code + lo
    return out


PAIR_BINS = 1 << 20
"""Most (a, b) pairs `pair_sums` tallies (two n x n tables of 8 bytes a pair: 16 MiB)."""


def smallest_int(col: np.ndarray) -> np.ndarray:
    """An integer column as int8 or int16 where its values fit (a new, smaller array), else
    itself (empty, not of integers, or 16 bits or narrower already)."""
    if len(col) == 0 or col.dtype.kind not in "iu" or col.dtype.itemsize <= 2:
        return col
    lo, hi = int(col.min()), int(col.max())
    for dt in (np.int8, np.int16):
        if np.iinfo(dt).min <= lo and hi <= np.iinfo(dt).max:
            return col.astype(dt)
    return col


def pair_sums(a: np.ndarray, b: np.ndarray, weights: np.ndarray, n: int
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """How many rows, and the sum of their `weights` (float64: exact for whole numbers below
    2^53, in any order), of each (a, b) pair of values in [0, n), as two n x n arrays (int64,
    float64); None where n x n is over `PAIR_BINS`. Summed a block of rows at a time in two
    buffers made once: no temporary as long as the columns (the int32 columns cast to
    bincount's intp, the weights to float64), whose fresh pages cost their zeroing."""
    if n * n > PAIR_BINS:
        return None
    count, total = np.zeros(n * n, dtype=np.int64), np.zeros(n * n)
    m = min(len(a), _BLOCK)
    key, w = np.empty(m, dtype=np.intp), np.empty(m, dtype=np.float64)
    for lo in range(0, len(a), _BLOCK):
        k, x = key[:min(_BLOCK, len(a) - lo)], w[:min(_BLOCK, len(a) - lo)]
        np.copyto(k, a[lo:lo + len(k)], casting="unsafe")
        k *= n
        k += b[lo:lo + len(k)]
        np.copyto(x, weights[lo:lo + len(k)], casting="unsafe")
        count += np.bincount(k, minlength=n * n)
        total += np.bincount(k, weights=x, minlength=n * n)
    return count.reshape(n, n), total.reshape(n, n)


class Scratch:
    """The buffer columns are put in order into (`np.take`), one after another, before each
    is read or copied where it goes (`emit`, `schedule`): one of the dtype last asked for,
    made once for every column of that dtype (a fresh temporary per column would fault its
    pages in afresh, each zeroed by the kernel)."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None

    def taken(self, col: np.ndarray, order: np.ndarray) -> np.ndarray:
        """`col[order]`, in the buffer (`order`: a permutation, every index in range)."""
        if self.buf is None or self.buf.dtype != col.dtype or len(self.buf) < len(order):
            self.buf = None  # (the last one freed before the next is made)
            self.buf = np.empty(len(order), dtype=col.dtype)
        out = self.buf[:len(order)]
        np.take(col, order, out=out, mode="clip")  # (no bounds to check: faster)
        return out

    def spare(self, dt: np.dtype, n: int) -> np.ndarray | None:
        """The buffer, given up, where it is `n` rows of `dt` (to hold a column: its pages
        are in already), else None."""
        buf = self.buf
        if buf is None or buf.dtype != dt or len(buf) != n:
            return None
        self.buf = None
        return buf
