"""Byte intervals `[lo, hi)` as numpy columns: shared by `verify` (reads inside written bytes,
the shadow section's runs), the early-pack rule (`schemas.protocol.Overlap`) and the
executor's pack pipeline (what a group's writes read). The `_by_group` functions answer for
intervals of many groups (stages) at once, as if each group were asked alone."""

from __future__ import annotations

import numpy as np


def distinct(a: np.ndarray) -> np.ndarray:
    """`np.unique(a)` of a 1-d array by one sort (numpy 2's default, a hash table, is many
    times slower on int64 columns of mostly distinct values), of the values that differ from
    the one before them only: a column of a plan's ops holds long runs of one value (a
    rank's writes, each with its stage and target), and a value equal to the one before it
    adds nothing to the set."""
    if len(a) > 1:
        new = np.empty(len(a), dtype=bool)
        new[0] = True
        np.not_equal(a[1:], a[:-1], out=new[1:])
        a = a[new]
    a = np.sort(a)
    keep = np.ones(len(a), dtype=bool)
    keep[1:] = a[1:] != a[:-1]
    return a[keep]


def ends_by_start(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Intervals `[lo, hi)` made ready for `meets`: the empty ones dropped, the rest by
    start, each end the furthest of those starting no later (prepared once where many
    questions are asked of the same intervals)."""
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    order = np.argsort(lo, kind="stable")
    return lo[order], np.maximum.accumulate(hi[order])


def meets(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether any interval of `a` shares a byte with one of `b`, given as
    `ends_by_start` made it."""
    (a_lo, a_hi), (b_lo, b_hi) = a, b
    keep = a_hi > a_lo
    a_lo, a_hi = a_lo[keep], a_hi[keep]
    if not len(a_lo) or not len(b_lo):
        return False
    k = np.searchsorted(b_lo, a_hi, side="left") - 1  # last of b starting before a ends
    return bool(((k >= 0) & (b_hi[np.maximum(k, 0)] > a_lo)).any())


def union(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted intervals covering the same bytes as `[lo, hi)`."""
    if len(lo) == 0:
        return lo, hi
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], np.maximum.accumulate(hi[order])
    new = np.ones(len(lo), dtype=bool)
    new[1:] = lo[1:] > hi[:-1]
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(lo)) - 1
    return lo[starts], hi[ends]


def keyed(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
          ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Intervals of many groups as one key space: each `(group, lo, hi)` of `parts` as
    `(lo', hi')` where `x' = g * m + k`, `g` the group's place among all groups, `k` the
    place of `x` among every end point of `parts` and `m` one more than their count. The
    map keeps the order of the ends within a group and puts each group after the last:
    unions, containment and overlaps of the keys are those of the intervals, group by
    group, with no interval of one group touching another's."""
    direct = _direct(parts)
    if direct is not None:
        return direct
    ends = distinct(np.concatenate([np.zeros(0, np.int64),
                                    *(x for _, lo, hi in parts for x in (lo, hi))]))
    groups = distinct(np.concatenate([np.zeros(0, np.int64), *(g for g, _, _ in parts)]))
    m = len(ends) + 1
    out = []
    for g, lo, hi in parts:
        base = np.searchsorted(groups, g).astype(np.int64) * m
        out.append((base + np.searchsorted(ends, lo), base + np.searchsorted(ends, hi)))
    return out


_SPAN = 1 << 62


def _direct(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
            ) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """`keyed`'s map without its sorts, where the numbers allow: `x' = (g - g0) * m + x - x0`,
    `g0` and `x0` the least group and end point, `m` two more than the span of the end
    points (so a group's keys end at least two before the next group's start, as in
    `keyed`). Every order among the keys, and so every union, containment and overlap,
    is the one `keyed` gives; None where a key could pass `_SPAN`."""
    ends = [x for _, lo, hi in parts for x in (lo, hi) if len(x)]
    groups = [g for g, _, _ in parts if len(g)]
    if not ends or not groups:
        return None
    x0 = min(int(x.min()) for x in ends)
    x1 = max(int(x.max()) for x in ends)
    g0 = min(int(g.min()) for g in groups)
    g1 = max(int(g.max()) for g in groups)
    m = x1 - x0 + 2
    if not (-_SPAN < x0 <= x1 < _SPAN and -_SPAN < g0 <= g1 < _SPAN) \
            or (g1 - g0 + 1) * m >= _SPAN:
        return None
    out = []
    for g, lo, hi in parts:
        base = (np.asarray(g, np.int64) - g0) * m - x0
        out.append((base + np.asarray(lo, np.int64), base + np.asarray(hi, np.int64)))
    return out


def outside_by_group(r_group: np.ndarray, r_lo: np.ndarray, r_hi: np.ndarray,
                     f_group: np.ndarray, f_lo: np.ndarray, f_hi: np.ndarray) -> np.ndarray:
    """Which non-empty reads `[r_lo, r_hi)` are not inside the bytes that the intervals
    `[f_lo, f_hi)` of their own group cover (one pass for every group)."""
    (r_lo2, r_hi2), (f_lo2, f_hi2) = keyed([(r_group, r_lo, r_hi), (f_group, f_lo, f_hi)])
    u_lo, u_hi = union(f_lo2, f_hi2)
    if not len(u_lo):
        return r_hi > r_lo
    k = np.searchsorted(u_lo, r_lo2, side="right") - 1
    inside = (k >= 0) & (u_hi[np.maximum(k, 0)] >= r_hi2)
    return ~inside & (r_hi > r_lo)


def overlap_by_group(a_group: np.ndarray, a_lo: np.ndarray, a_hi: np.ndarray,
                     b_group: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray) -> np.ndarray:
    """Which non-empty intervals `[a_lo, a_hi)` share a byte with a non-empty `[b_lo, b_hi)`
    of their own group (one pass for every group)."""
    keep = b_hi > b_lo
    (a_lo2, a_hi2), (b_lo2, b_hi2) = keyed([(a_group, a_lo, a_hi),
                                            (b_group[keep], b_lo[keep], b_hi[keep])])
    if not len(b_lo2):
        return np.zeros(len(a_lo), dtype=bool)
    order = np.argsort(b_lo2, kind="stable")
    b_lo2, reach = b_lo2[order], np.maximum.accumulate(b_hi2[order])
    k = np.searchsorted(b_lo2, a_hi2, side="left") - 1  # the last b starting before a ends
    return (k >= 0) & (reach[np.maximum(k, 0)] > a_lo2) & (a_hi > a_lo)


def first_overlap_by_group(group: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The groups in which an interval `[lo, hi)` starts before another of its group ends
    (`schemas.runs.first_overlap` group by group), sorted."""
    ((lo2, hi2),) = keyed([(group, lo, hi)])
    if len(lo2) < 2:
        return np.zeros(0, np.int64)
    order = np.argsort(lo2, kind="stable")
    lo2, reach = lo2[order], np.maximum.accumulate(hi2[order])
    bad = np.flatnonzero(lo2[1:] < reach[:-1]) + 1
    return distinct(group[order][bad])
