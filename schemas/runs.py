"""The exact bytes of copies' strided boxes, as contiguous runs: what `verify` checks byte by
byte (`planner/tools/verify_rank.py`: coverage, dataflow, the shadow's regions) and what the
executor's load checks for a rank's own PACKs (`schemas/rankcheck.py`: `packs`).

A box's extent (`schemas.protocol.copy_footprint`) holds every byte it touches, but two
strided boxes can interleave (even rows and odd rows of one block) with overlapping extents
and no byte in common: rules about bytes are decided here, on runs.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import PlanFormatError
from .plan import RankPlan
from .protocol import ITEM

MAX_COPY_RUNS = 1 << 24
"""Contiguous runs of one copy's box that `copy_runs` lists (a compiled copy has at most a
box's rows)."""
EMPTY = (np.zeros(0, np.int64), np.zeros(0, np.int64))


def box_runs(sizes: tuple[int, ...], strides: tuple[int, ...],
             limit: int = MAX_COPY_RUNS) -> tuple[np.ndarray, int]:
    """Start offsets (elements) of the contiguous runs of one box, and the run length. The
    box is a set of elements: its dims are taken by stride, smallest first, and merged
    while each steps exactly over the run so far (a transposed box is one run)."""
    dims = sorted(((n, st) for n, st in zip(sizes, strides) if n > 1), key=lambda d: d[1])
    run = 1
    while dims and dims[0][1] == run:
        run *= dims.pop(0)[0]
    count = math.prod(n for n, _ in dims)
    if count > limit:
        raise PlanFormatError(f"a copy is cut into {count:,} runs, more than the checks "
                              f"list ({limit:,}); the plan is corrupt")
    start = np.zeros(1, dtype=np.int64)
    for n, st in dims:
        start = (start[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
    return start, run


def run_count(sizes: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """How many runs `box_runs` cuts one box into (without listing them)."""
    dims = sorted(((n, st) for n, st in zip(sizes, strides) if n > 1), key=lambda d: d[1])
    run = 1
    while dims and dims[0][1] == run:
        run *= dims.pop(0)[0]
    return math.prod(n for n, _ in dims) if all(n > 0 for n in sizes) else 0


def _shapes(rp: RankPlan, rows: np.ndarray, side: str
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows, order, cuts, shapes): non-empty `rows` grouped by box shape (sizes, strides)."""
    c = rp.copies
    key = np.stack([c[f"size{d}"][rows] for d in range(3)]
                   + [c[f"{side}_stride{d}"][rows] for d in range(3)], axis=1).astype(np.int64)
    if (key[:, :3] == 0).any():  # an empty box touches nothing
        keep = (key[:, :3] > 0).all(axis=1)
        rows, key = rows[keep], key[keep]
    order = np.lexsort(key.T[::-1])  # by box shape (a row-wise unique, without its cost)
    key = key[order]
    new = np.ones(len(key), dtype=bool)
    new[1:] = (key[1:] != key[:-1]).any(axis=1)
    return rows, order, np.append(np.flatnonzero(new), len(key)), key[new]


def row_runs(rp: RankPlan, rows: np.ndarray, side: str) -> np.ndarray:
    """How many runs `copy_runs` lists for each of `rows` (0 for an empty box), counted per
    box shape without listing them."""
    rows = np.asarray(rows, dtype=np.int64)
    out = np.zeros(len(rows), dtype=np.int64)
    if not len(rows):
        return out
    if len(np.unique(rows)) != len(rows):
        raise ValueError("row_runs: rows must be distinct")
    kept, order, cuts, shapes = _shapes(rp, rows, side)
    counts = np.zeros(len(kept), dtype=np.int64)
    for g, s in enumerate(shapes.tolist()):
        counts[order[cuts[g]:cuts[g + 1]]] = run_count(tuple(s[:3]), tuple(s[3:]))
    by = np.argsort(rows, kind="stable")
    out[by[np.searchsorted(rows, kept, sorter=by)]] = counts
    return out


def total_runs(rp: RankPlan, rows: np.ndarray, side: str) -> int:
    """How many runs `copy_runs(rp, rows, side)` lists, counted per box shape."""
    return int(row_runs(rp, rows, side).sum())


def copy_runs(rp: RankPlan, rows: np.ndarray, side: str
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, lo, hi): byte intervals `[lo, hi)` that copies `rows` touch on `side`, one per
    contiguous run of their strided boxes; copies of one box shape share one pattern.
    Values must be in range (`schemas.protocol.copy_value_problems`)."""
    c = rp.copies
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return rows, *EMPTY
    rows, order, cuts, shapes = _shapes(rp, rows, side)
    es = ITEM[np.clip(c[f"{side}_dtype"][rows].astype(np.int64), 0, len(ITEM) - 1)]
    off = c[f"{side}_offset"][rows].astype(np.int64)
    out_r, out_lo, out_hi = [rows[:0]], [EMPTY[0]], [EMPTY[1]]
    for g, shape in enumerate(shapes.tolist()):
        members = order[cuts[g]:cuts[g + 1]]
        start, run = box_runs(tuple(shape[:3]), tuple(shape[3:]))
        lo = (off[members, None] + start[None, :]) * es[members, None]
        out_r.append(np.repeat(rows[members], len(start)))
        out_lo.append(lo.reshape(-1))
        out_hi.append((lo + run * es[members, None]).reshape(-1))
    return np.concatenate(out_r), np.concatenate(out_lo), np.concatenate(out_hi)


def first_overlap(lo: np.ndarray, hi: np.ndarray) -> int | None:
    """A byte where two intervals of `[lo, hi)` overlap, or None."""
    if len(lo) < 2:
        return None
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], np.maximum.accumulate(hi[order])
    bad = lo[1:] < hi[:-1]
    return int(lo[int(np.argmax(bad)) + 1]) if bad.any() else None
