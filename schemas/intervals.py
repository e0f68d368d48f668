"""Byte intervals `[lo, hi)` as numpy columns: shared by `verify` (reads inside written bytes,
the shadow section's runs) and the executor's pack pipeline (what a group's writes read)."""

from __future__ import annotations

import numpy as np


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
