"""What the gather pass (`gather.py`) builds: each rank's staging, allocated per stage in
two pools (`Staging`), and the writes and copies it emits (`Out`), turned into the
`Lowered` columns the later passes take (`lowered`); `Rows`, the columns it reads row by
row."""

from __future__ import annotations

import numpy as np

from planner.passes.lower import ALIGN, Lowered
from schemas.plan import COPY_COLUMNS


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    """Bump allocation of each rank's staging per stage, in two pools: pool 0, at most
    `budget - budget // 4` bytes (rounded down to `ALIGN`), for the boxes a rank owns, and
    pool 1, at most the rest, for the parts it packs for other owners (so those packs never
    fall back to row-by-row writes). The budget is a cap: pool 0 starts at byte 0 and is
    as large as its peak; pool 1 starts where pool 0 ends on that rank (`pool1`), known
    once every box is placed, so `take` gives pool-1 offsets from the pool's start."""

    def __init__(self, world: int, budget: int) -> None:
        self.used: dict[tuple[int, int, int], int] = {}
        split = (budget - budget // 4) // ALIGN * ALIGN
        self.caps = (split, budget - split)
        self._peak = [[0, 0] for _ in range(world)]  # lists: read and set one at a time

    def _start(self, rank: int, stages: tuple[int, ...], pool: int) -> int:
        get = self.used.get
        return max([get((rank, s, pool), 0) for s in stages])

    def fits(self, rank: int, stages: tuple[int, ...], nbytes: int, pool: int = 0) -> bool:
        return self._start(rank, stages, pool) + align(nbytes) <= self.caps[pool]

    def take(self, rank: int, stages: tuple[int, ...], nbytes: int, pool: int = 0) -> int:
        """Offset (from the pool's start) of `nbytes` live in every stage of `stages` on
        `rank`."""
        start = self._start(rank, stages, pool)
        end = start + align(nbytes)
        for s in stages:
            self.used[(rank, s, pool)] = end
        peak = self._peak[rank]
        if end > peak[pool]:
            peak[pool] = end
        return start

    @property
    def peak(self) -> np.ndarray:
        """Per rank and pool: the bytes used at the peak."""
        return np.array(self._peak, dtype=np.int64).reshape(-1, 2)

    @property
    def pool1(self) -> np.ndarray:
        """Per rank: the byte where pool 1 starts."""
        return self.peak[:, 0]

    @property
    def staging(self) -> np.ndarray:
        """Per rank: the staging bytes both pools use at their peaks."""
        return self.peak.sum(axis=1)


class Rows:
    """Some columns of a table as Python lists, for reads of one row at a time (a numpy
    scalar costs ~10x more)."""

    def __init__(self, table: object, columns: tuple[str, ...]) -> None:
        for c in columns:
            setattr(self, c, getattr(table, c).tolist())


class ScaleRows:
    """The row of a table of FP8 scale pieces by (rank, scale tensor, block row, block
    column), i.e. its (rank, tensor, off0, off1): where keys repeat, the last such row;
    -1 where none."""

    def __init__(self, s: object) -> None:
        cols = [np.asarray(getattr(s, c), dtype=np.int64) for c in ("rank", "tensor", "off0",
                                                                     "off1")]
        self.dims = tuple(int(c.max()) + 1 if len(c) else 1 for c in cols)
        keys = np.ravel_multi_index(cols, self.dims) if len(cols[0]) else cols[0]
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]

    def __call__(self, rank: np.ndarray, tensor: np.ndarray, b0: np.ndarray,
                 b1: np.ndarray) -> np.ndarray:
        q = [np.asarray(x, dtype=np.int64) for x in (rank, tensor, b0, b1)]
        ok = np.logical_and.reduce([(x >= 0) & (x < d) for x, d in zip(q, self.dims)])
        key = np.ravel_multi_index([np.where(ok, x, 0) for x in q], self.dims)
        at = np.searchsorted(self.keys, key, side="right") - 1
        found = ok & (at >= 0) & (self.keys[at.clip(min=0)] == key) if len(self.keys) else \
            np.zeros(len(key), dtype=bool)
        return np.where(found, self.order[at.clip(min=0)] if len(self.keys) else -1, -1)


class Out:
    """Rows of writes and copies, turned into columns at the end."""

    W = ("src_rank", "src_region", "src_offset", "dst_rank", "dst_region", "dst_offset",
         "nbytes", "stage")
    C = ("rank", *(n for n, _ in COPY_COLUMNS))

    def __init__(self) -> None:
        self.writes: list[tuple[int, ...]] = []
        self.strided: list[tuple[int, ...]] = []
        """Runs of several writes: (*src, *dst, rows, row_bytes, src_stride, dst_stride,
        stage), expanded into rows at the end (`lowered`), after `writes`."""
        self.copies: list[tuple[int, ...]] = []
        self.explain: list[tuple[int, int, int, int, int, int]] = []
        self.pool1: list[tuple[int, int, int, int]] = []
        """(copy, write, rank, element size): a PACK into pool 1 and the write of it, whose
        offsets count from the pool's start (`Staging`)."""
        none = np.zeros((0, 8), dtype=np.int64)
        self.pre_writes, self.pre_strided = none, np.zeros((0, 11), dtype=np.int64)
        self.pre_copies = np.zeros((0, len(Out.C)), dtype=np.int64)
        self.pre_explain = np.zeros((0, 6), dtype=np.int64)
        """Rows (as above) that come before those of the lists, made as columns
        (`gather_direct.py`)."""

    def last(self) -> tuple[int, int]:
        """Row numbers of the last copy and the last write (of one row) so far."""
        return len(self.pre_copies) + len(self.copies) - 1, \
            len(self.pre_writes) + len(self.writes) - 1

    def copy(self, row: tuple[int, ...]) -> None:
        """A copy: its Python ints in `Out.C` order."""
        self.copies.append(row)

    def runs(self, stage: int, src: tuple[int, int, int], dst: tuple[int, int, int],
             rows: int, row_bytes: int, src_stride: int, dst_stride: int) -> None:
        """`rows` writes of `row_bytes` (byte strides), or one when both sides are dense."""
        if rows == 1 or (src_stride == row_bytes and dst_stride == row_bytes):
            self.writes.append((*src, *dst, rows * row_bytes, stage))
        else:
            self.strided.append((*src, *dst, rows, row_bytes, src_stride, dst_stride, stage))


def explain_rows(out: Out) -> np.ndarray:
    """(tensor, owner, staging region, target rank, target region, bytes) per fan-out."""
    return np.concatenate([out.pre_explain, np.array(out.explain, dtype=np.int64).reshape(-1, 6)])


def lowered(out: Out, alloc: Staging, stages: int) -> Lowered:
    strided = np.concatenate([out.pre_strided,
                              np.array(out.strided, dtype=np.int64).reshape(-1, 11)])
    w = np.concatenate([out.pre_writes, np.array(out.writes, dtype=np.int64).reshape(-1, 8),
                        _expand(strided)])
    c = np.concatenate([out.pre_copies,
                        np.array(out.copies, dtype=np.int64).reshape(-1, len(Out.C))])
    if out.pool1:  # pool 1 starts where pool 0 ends on its rank
        ci, wi, rank, es = np.array(out.pool1, dtype=np.int64).T
        c[ci, Out.C.index("dst_offset")] += alloc.pool1[rank] // es
        w[wi, Out.W.index("src_offset")] += alloc.pool1[rank]
    copies = {name: c[:, i] for i, name in enumerate(Out.C)}
    return Lowered(*(w[:, i] for i in range(8)), copies=copies, staging=alloc.staging,
                   stages=stages)


def _expand(runs: np.ndarray) -> np.ndarray:
    """Runs (`Out.strided`) as their writes (`Out.W` columns), run by run, row by row."""
    rows = runs[:, 6]
    run = np.repeat(np.arange(len(runs)), rows)
    k = np.arange(len(run), dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)
    out = np.empty((len(run), 8), dtype=np.int64)
    for j, c in enumerate((0, 1, 2, 3, 4, 5, 7, 10)):
        out[:, j] = runs[run, c]
    out[:, 2] += k * runs[run, 8]
    out[:, 5] += k * runs[run, 9]
    return out
