"""The explain table (`Plan.explain`): bytes and boxes per (tensor, source region, target
region), the plan's record of which source bytes feed which target. Its rows are made by
the compiler after assign (the direct path's chunks, `compiler._explain_rows`) and by
gather (`gather_out`), joined (`explain_with`) and, in a compile that writes the plan,
spilled to a mapped unnamed file as they are made (`spilled`), the columns' ranges taken
as they are written (the plan writer reads them once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from planner.rows import column_keys, stable_argsort
from schemas.plan import EXPLAIN_COLUMNS, Table
from schemas.table import RangedTable


def explain_table(tensor: np.ndarray, src_rank: np.ndarray, src_region: np.ndarray,
                  dst_rank: np.ndarray, dst_region: np.ndarray, nbytes: np.ndarray,
                  boxes: np.ndarray | None = None, replicas: int = 1, spill: bool = False
                  ) -> Table:
    """Bytes and boxes per (tensor, source region, target region), sorted by those keys
    (`boxes`: how many boxes each row stands for; one each when not given). Runs of equal
    consecutive rows (a chunk cut in parts) are summed before the rows are sorted.

    `replicas` > 1: the rows may be that many equal blocks, each the first with its target
    ranks moved by a multiple of one shift (the target engine's replicas, fed alike); when
    they are (`_replica_shift` checks it), the first block's table is made and repeated
    for the others (`_stamped_columns`): the same table, without sorting every block's rows.

    `spill`: the table `spilled`, its repeated columns made and written one at a time (the
    whole table is never held in memory)."""
    cols = (tensor, src_rank, src_region, dst_rank, dst_region, nbytes)
    if boxes is not None:
        table = _explain(*cols, boxes) if len(tensor) else Table.empty(EXPLAIN_COLUMNS)
        return spilled(table) if spill else table
    return explain_rows(lambda rows: tuple(c[rows] for c in cols), len(tensor), replicas,
                        spill)


Rows = Callable[[slice], tuple[np.ndarray, ...]]
"""The six explain columns (`explain_table`'s) of a slice of rows, made when asked for."""


def explain_rows(rows: Rows, n: int, replicas: int = 1, spill: bool = False) -> Table:
    """`explain_table` of `n` rows given by `rows` (one box each): with `replicas` > 1, the
    rows are asked for one block at a time (the blocks checked alike, `_replica_shift`), so
    the whole rows are made only when the blocks are not alike."""
    if n == 0:
        return Table.empty(EXPLAIN_COLUMNS)
    alike = _replica_shift(rows, n, replicas) if replicas > 1 else None
    if alike is not None:
        shift, first = alike
        one = _explain(*first, None)
        del first, alike
        if spill:
            return _spill(EXPLAIN_COLUMNS, _stamped_columns(one, replicas, shift))
        return Table.build(EXPLAIN_COLUMNS, **{name: np.concatenate([p.copy() for p in col])
                                               for (name, _), col in zip(
            EXPLAIN_COLUMNS, _stamped_columns(one, replicas, shift))})
    table = _explain(*rows(slice(0, n)), None)
    return spilled(table) if spill else table


def _replica_shift(rows: Rows, n: int, replicas: int
                   ) -> tuple[int, list[np.ndarray]] | None:
    """The shift of target ranks from block to block when the `n` rows (explain_table's six
    columns, `rows`) are `replicas` blocks of equal length, every column but the target
    rank equal to the first block's and the target rank the first block's plus `r * shift`
    in block r, with `shift` larger than the span of the first block's target ranks (so
    each block's ranks come after the previous one's), with the first block's columns (made
    once: the caller's table is made from them); else None. The blocks are made one at a
    time."""
    if n % replicas:
        return None
    n //= replicas
    first = [np.asarray(c) for c in rows(slice(0, n))]
    dst = first[3]
    lo, hi = int(dst.min()), int(dst.max())
    shift = None
    for r in range(1, replicas):
        block = rows(slice(r * n, (r + 1) * n))
        if shift is None:
            shift = int(block[3][0]) - int(dst[0])
            if shift <= hi - lo:
                return None
        for k, (c, f) in enumerate(zip(block, first)):
            if k == 3:
                if not (np.subtract(c, f, dtype=np.int64) == r * shift).all():
                    return None
            elif not np.array_equal(c, f):
                return None
        del block
    return shift, first


STAMP_ROWS = 1 << 20
"""Rows of a stamped column made at a time (`_stamped_columns`): one buffer reused."""


def _stamped_columns(one: Table, replicas: int, shift: int
                     ) -> Iterator[Iterator[np.ndarray]]:
    """The columns (`EXPLAIN_COLUMNS`' order and dtypes), made one at a time, of the explain
    table of `replicas` blocks alike (`_replica_shift`), from the first block's (`one`):
    each (tensor, source rank, source region) group of its rows, once per block in block
    order, target ranks moved by `r * shift` in block r (the rows' sorted order: within a
    group, the blocks' target ranks follow one another). Each column is given as its
    pieces in order (`_gathered`: `STAMP_ROWS` rows each, in one buffer that the next
    piece overwrites), so no column is held whole."""
    m = len(one["tensor"])
    if m == 0:
        yield from ([c] for c in one.columns)
        return
    same = np.ones(m - 1, dtype=bool)
    for name in ("tensor", "src_rank", "src_region"):
        c = one[name]
        same &= c[1:] == c[:-1]
    dt = np.int32 if m * replicas < 1 << 31 else np.int64  # row numbers
    g_start = np.flatnonzero(np.concatenate([[True], ~same])).astype(dt)
    g_len = np.diff(np.append(g_start, m)).astype(dt)
    # the output as runs, one per (group, block) in that order: a run is its group's rows
    # (no division per row: each row's source row and block are repeated from its run's)
    run_len = np.repeat(g_len, replicas)
    run_at = np.cumsum(run_len, dtype=dt) - run_len  # where each run starts in the output
    i = np.arange(m * replicas, dtype=dt)
    i += np.repeat(np.repeat(g_start, replicas) - run_at, run_len)
    del run_at
    # block r's target ranks + r * shift (every sum a target rank)
    moved = np.repeat(np.tile(np.arange(0, replicas * shift, shift, dtype=dt), len(g_start)),
                      run_len)
    del run_len
    for name, _ in EXPLAIN_COLUMNS:
        yield _gathered(one[name], i, moved if name == "dst_rank" else None)


def _gathered(col: np.ndarray, i: np.ndarray, add: np.ndarray | None
              ) -> Iterator[np.ndarray]:
    """`col[i] (+ add)` in pieces of `STAMP_ROWS` rows, each in the same buffer."""
    buf = np.empty(min(STAMP_ROWS, len(i)), dtype=col.dtype)
    for lo in range(0, len(i), STAMP_ROWS):
        out = buf[:min(STAMP_ROWS, len(i) - lo)]
        np.take(col, i[lo:lo + len(out)], out=out)
        if add is not None:
            np.add(out, add[lo:lo + len(out)], out=out, casting="same_kind")
        yield out


def _explain(tensor: np.ndarray, src_rank: np.ndarray, src_region: np.ndarray,
             dst_rank: np.ndarray, dst_region: np.ndarray, nbytes: np.ndarray,
             boxes: np.ndarray | None) -> Table:
    """`explain_table` of its rows, sorted."""
    keys = [np.asarray(c, dtype=np.int32) for c in  # as in the table
            (tensor, src_rank, src_region, dst_rank, dst_region)]
    key = column_keys(keys)
    start = _starts(key)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    if start is None:  # no two consecutive rows alike (every chunk whole): no runs to sum
        run_bytes = nbytes
        run_boxes = np.ones(len(key), np.int32 if len(key) < 1 << 31 else np.int64) \
            if boxes is None else np.asarray(boxes, dtype=np.int64)
    else:
        run_bytes = np.add.reduceat(nbytes, start)
        run_boxes = np.diff(np.append(start, len(key)).astype(
            np.int32 if len(key) < 1 << 31 else np.int64)) if boxes is None else \
            np.add.reduceat(np.asarray(boxes, dtype=np.int64), start)
        key = key[start]
    del nbytes
    order = stable_argsort(key)  # (equal keys are equal rows: any order among them)
    key = key[order]
    first = _starts(key)
    del key
    if first is None:  # every row distinct: nothing to sum
        rows = order if start is None else start[order]
        total, count = run_bytes[order], run_boxes[order]
    else:
        rows = order[first] if start is None else start[order[first]]
        total = np.add.reduceat(run_bytes[order], first)
        count = np.add.reduceat(run_boxes[order], first)
    del run_bytes, run_boxes, order, start
    return Table.build(EXPLAIN_COLUMNS, **{name: k[rows] for (name, _), k in zip(
        EXPLAIN_COLUMNS, keys)}, nbytes=total, boxes=count)


def _starts(key: np.ndarray) -> np.ndarray | None:
    """Where each run of equal consecutive keys starts; None when every run is one key."""
    new = key[1:] != key[:-1]
    if new.all():
        return None
    return np.flatnonzero(np.concatenate([[True], new]))


def spilled(table: Table) -> Table:
    """`table` with its columns written to an unnamed temporary file and mapped back
    read-only: the same table, whose bytes are in the page cache instead of this process
    until read (the compiler holds the explain table from assign to the plan's writing;
    a large model's is hundreds of MB)."""

    if sum(c.nbytes for c in table.columns) == 0:
        return table
    return _spill(table.schema, iter(table.columns))


def _spill(schema: tuple[tuple[str, str], ...],
           columns: Iterator[np.ndarray | Iterator[np.ndarray]]) -> Table:
    """`spilled` of the table of `columns` (in `schema`'s order and dtypes), each written
    as it is made and dropped: the columns are never all held. A column may be given as
    its pieces in order (`_stamped_columns`), each written before the next is asked for."""
    import mmap
    import tempfile

    lengths, ranges = [], []
    with tempfile.TemporaryFile() as f:
        for (name, dt), col in zip(schema, columns):
            n, lo, hi = 0, None, None
            for c in [col] if isinstance(col, np.ndarray) else col:
                c = np.ascontiguousarray(c, dtype=dt)
                if c.ndim != 1:
                    raise ValueError(f"explain column {name!r} has shape {c.shape}")
                if len(c) and c.dtype.kind in "iu":  # (while its pages are at hand)
                    a, b = int(c.min()), int(c.max())
                    lo, hi = a if lo is None else min(lo, a), b if hi is None else max(hi, b)
                f.write(memoryview(c).cast("B"))
                n += len(c)
                del c
            if lengths and n != lengths[0]:
                raise ValueError(f"explain column {name!r} has {n} rows, not {lengths[0]}")
            lengths.append(n)
            ranges.append(None if lo is None else (lo, hi))
        f.flush()
        size = sum(n * np.dtype(dt).itemsize for n, (_, dt) in zip(lengths, schema))
        if size == 0:
            return Table.build(schema, **{name: np.zeros(n, dt) for n, (name, dt) in zip(
                lengths, schema)})
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)  # outlives the file
    cols, at = [], 0
    for n, (_, dt) in zip(lengths, schema):
        cols.append(np.frombuffer(m, dtype=dt, count=n, offset=at))
        at += n * np.dtype(dt).itemsize
    return RangedTable(schema, tuple(cols), tuple(ranges))  # (the writer reads the ranges)


def explain_with(table: Table, rows: np.ndarray) -> Table:
    """`table` (of `explain_table`) with more `rows` (tensor, source rank, source region,
    target rank, target region, bytes: one box each), as one explain table."""
    if len(rows) == 0:
        return table
    cols = [np.concatenate([table[name], rows[:, i]])
            for i, (name, _) in enumerate(EXPLAIN_COLUMNS[:6])]
    return explain_table(*cols, boxes=np.concatenate([table["boxes"],
                                                      np.ones(len(rows), np.int64)]))
