"""What the gather pass (`gather.py`) builds: each rank's staging, allocated per stage in
two pools (`Staging`), and the writes and copies it emits (`Out`), turned into the
`Lowered` columns the later passes take (`lowered`); `Rows`, the columns it reads row by
row."""

from __future__ import annotations

from operator import itemgetter

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
        self.peak = np.zeros((world, 2), dtype=np.int64)

    def _start(self, rank: int, stages: tuple[int, ...], pool: int) -> int:
        return max(self.used.get((rank, s, pool), 0) for s in stages)

    def fits(self, rank: int, stages: tuple[int, ...], nbytes: int, pool: int = 0) -> bool:
        return self._start(rank, stages, pool) + align(nbytes) <= self.caps[pool]

    def take(self, rank: int, stages: tuple[int, ...], nbytes: int, pool: int = 0) -> int:
        """Offset (from the pool's start) of `nbytes` live in every stage of `stages` on
        `rank`."""
        start = self._start(rank, stages, pool)
        for s in stages:
            self.used[(rank, s, pool)] = start + align(nbytes)
        self.peak[rank, pool] = max(self.peak[rank, pool], start + align(nbytes))
        return start

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


class Out:
    """Rows of writes and copies, turned into columns at the end."""

    W = ("src_rank", "src_region", "src_offset", "dst_rank", "dst_region", "dst_offset",
         "nbytes", "stage")
    C = ("rank", *(n for n, _ in COPY_COLUMNS))

    def __init__(self) -> None:
        self.writes: list[tuple[int, ...]] = []
        self.strided: list[np.ndarray] = []
        self.copies: list[tuple[int, ...]] = []
        self.explain: list[tuple[int, int, int, int, int, int]] = []
        self.pool1: list[tuple[int, int, int, int]] = []
        """(copy, write, rank, element size): a PACK into pool 1 and the write of it, whose
        offsets count from the pool's start (`Staging`)."""

    def copy(self, **cols: int) -> None:
        self.copies.append(tuple(map(int, _copy_row(cols))))

    def runs(self, stage: int, src: tuple[int, int, int], dst: tuple[int, int, int],
             rows: int, row_bytes: int, src_stride: int, dst_stride: int) -> None:
        """`rows` writes of `row_bytes` (byte strides), or one when both sides are dense."""
        if rows == 1 or (src_stride == row_bytes and dst_stride == row_bytes):
            self.writes.append((*src, *dst, rows * row_bytes, stage))
            return
        k = np.arange(rows, dtype=np.int64)
        one = np.ones(rows, dtype=np.int64)
        self.strided.append(np.stack([one * src[0], one * src[1], src[2] + k * src_stride,
                                      one * dst[0], one * dst[1], dst[2] + k * dst_stride,
                                      one * row_bytes, one * stage], axis=1))



def explain_rows(out: Out) -> np.ndarray:
    """(tensor, owner, staging region, target rank, target region, bytes) per fan-out."""
    return np.array(out.explain, dtype=np.int64).reshape(-1, 6)


def lowered(out: Out, alloc: Staging, stages: int) -> Lowered:
    w = np.concatenate([np.array(out.writes, dtype=np.int64).reshape(-1, 8), *out.strided])
    c = np.array(out.copies, dtype=np.int64).reshape(-1, len(Out.C))
    if out.pool1:  # pool 1 starts where pool 0 ends on its rank
        ci, wi, rank, es = np.array(out.pool1, dtype=np.int64).T
        c[ci, Out.C.index("dst_offset")] += alloc.pool1[rank] // es
        w[wi, Out.W.index("src_offset")] += alloc.pool1[rank]
    copies = {name: c[:, i] for i, name in enumerate(Out.C)}
    return Lowered(*(w[:, i] for i in range(8)), copies=copies, staging=alloc.staging,
                   stages=stages)


_copy_row = itemgetter(*Out.C)
"""A copy's columns in `Out.C` order, from its keyword arguments."""
