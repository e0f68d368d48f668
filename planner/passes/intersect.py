"""Passes 3 and 5 (piece tables, `intersect`): target pieces x source pieces over the same
logical boxes.

Every piece becomes a row of columnar arrays (`PieceTable`): its logical box, and the
affine map from logical index to element offset in its physical tensor:
`offset(i0, i1) = base + i0 * a0 + i1 * a1` (1-d logical tensors are `[n, 1]`).

Source pieces with equal boxes are replicas of one *source box*; a target piece is cut
by the source boxes it overlaps into *chunks*. Each chunk keeps its candidate holders
(the replicas of its source box) for `assign` to choose from. Work is vectorised: the
join runs per logical tensor over unique boxes only, never per byte range.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from operator import is_, mul
from typing import Any

import numpy as np

from planner.layouts.base import Layout, PhysicalTensor, PieceColumns
from planner.rows import stable_argsort, unique_columns
from planner.spec import ModelSpec
from schemas.plan import DTYPE_CODES
from schemas.protocol import ITEM


@dataclass(frozen=True, slots=True)
class PieceTable:
    """One side's pieces as columns; `rank` is the plan rank. Columns are int32 where every
    value and every element offset made from them fits (`piece_table`), else int64."""

    rank: np.ndarray
    region: np.ndarray
    tensor: np.ndarray
    off0: np.ndarray
    off1: np.ndarray
    size0: np.ndarray
    size1: np.ndarray
    base: np.ndarray
    a0: np.ndarray
    a1: np.ndarray
    dtype: np.ndarray
    """dtype code (`schemas.plan.DTYPE_CODES`) of the physical tensor."""

    def __len__(self) -> int:
        return len(self.rank)


@dataclass(frozen=True, slots=True)
class Chunks:
    """Target boxes, each fed by one source box (several candidate holders)."""

    tensor: np.ndarray
    off0: np.ndarray
    off1: np.ndarray
    size0: np.ndarray
    size1: np.ndarray
    dst: np.ndarray
    """Row of the target piece in the target `PieceTable`."""
    sbox: np.ndarray
    """Source box id; its holders are `holders[holder_ptr[sbox]:holder_ptr[sbox + 1]]`."""
    holder_ptr: np.ndarray
    holders: np.ndarray
    """Rows of the source `PieceTable`, grouped by source box."""

    def __len__(self) -> int:
        return len(self.tensor)


def take(t: PieceTable, rows: np.ndarray) -> PieceTable:
    """The rows `rows` of a piece table, as a new table."""
    return PieceTable(*(getattr(t, f)[rows] for f in PieceTable.__slots__))


def without_holders(chunks: Chunks) -> Chunks:
    """`chunks` less their source boxes and holders (empty): what `lower` and the explain
    table read, once `assign` has chosen."""
    none = np.zeros(0, dtype=np.int64)
    return Chunks(tensor=chunks.tensor, off0=chunks.off0, off1=chunks.off1,
                  size0=chunks.size0, size1=chunks.size1, dst=chunks.dst, sbox=none,
                  holder_ptr=none, holders=none)


def piece_table(layout: Layout, spec: ModelSpec, rank_base: int) -> PieceTable:
    """Flatten a layout's pieces into columns (plan rank = rank_base + layout rank).

    A rank's rows are built once for every rank holding the same tensors (replicas share
    their engine rank's tuple), a tensor's once for every rank holding it, and the pieces of
    a `PieceColumns` from its columns; each column of the table is one contiguous array."""
    return _flatten(layout, spec, rank_base, False)[0]


def table_and_boxes(layout: Layout, spec: ModelSpec, rank_base: int
                    ) -> tuple[PieceTable, Boxes]:
    """`piece_table` and its `boxes`, found among the rows of its distinct ranks only (a
    replica's rows are its engine rank's). Where the layout's replicas are alike (each
    replica's k-th rank holds the first replica's k-th rank's tensors, its rank moved by
    one step a replica), the table's columns and the boxes' `of` are `Repeated` columns
    of the first replica's rows: the whole table is never held."""
    table, found = _flatten(layout, spec, rank_base, True, _alike_replicas(layout))
    assert found is not None
    return table, found


def _alike_replicas(layout: Layout) -> int:
    """`layout.replicas` where its ranks are that many blocks alike (each block's k-th rank
    holding the first block's k-th rank's tensors, the same objects (`_same`), its rank
    moved by one step a block), else 1."""
    times, ranks = layout.replicas, layout.ranks
    if times < 2 or len(ranks) % times or not ranks:
        return 1
    m = len(ranks) // times
    step = ranks[m].rank - ranks[0].rank
    for at, rl in enumerate(ranks[m:], m):
        k, i = divmod(at, m)
        if not _same(rl.tensors, ranks[i].tensors) or rl.rank != ranks[i].rank + k * step:
            return 1
    return times


def _same(a: tuple[PhysicalTensor, ...], b: tuple[PhysicalTensor, ...]) -> bool:
    """Whether two ranks' tensors are the same objects (one tuple, or tuples of the same
    tensors: a quantized layout's ranks, `fp8.quantize_layout`)."""
    return a is b or (len(a) == len(b) and all(map(is_, a, b)))


def _flatten(layout: Layout, spec: ModelSpec, rank_base: int, with_boxes: bool,
             times: int = 1) -> tuple[PieceTable, Boxes | None]:
    """The table (and its boxes) of `layout`'s ranks; `times` > 1: of its first
    `1 / times` ranks, as `Repeated` columns (`_alike_replicas`)."""
    every = layout.ranks
    step = every[len(every) // times].rank - every[0].rank if times > 1 else 0
    layout_ranks = every[:len(every) // times]
    tensor_id = {t.name: i for i, t in enumerate(spec.tensors)}
    cache: dict[int, Any] = {}  # id(physical tensor) -> its (9, n) rows; id(names) -> ids
    ranks: dict[int, int] = {}  # id(a rank's tensors) -> its block
    blocks: list[np.ndarray] = []  # (10, n) rows of each distinct rank, region first
    used: list[int] = []  # block of each rank
    made: list[int] = []  # the rank (index) where each block is first used
    for rl in layout_ranks:
        b = ranks.get(id(rl.tensors))
        if b is None:
            b = ranks[id(rl.tensors)] = len(blocks)
            blocks.append(_rank_rows(rl.tensors, tensor_id, cache))
            made.append(len(used))
        used.append(b)
    sizes = np.array([blocks[b].shape[1] for b in used], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    out = np.empty((11, int(sizes.sum())), dtype=_column_dtype(blocks, rank_base + len(every)))
    for rl, b, at in zip(layout_ranks, used, starts.tolist()):
        out[0, at:at + blocks[b].shape[1]] = rank_base + rl.rank
        out[1:, at:at + blocks[b].shape[1]] = blocks[b]
    out.flags.writeable = False  # `intersect`'s chunks may share its columns
    table = PieceTable(*out) if times == 1 else \
        PieceTable(*(Repeated(col, times, step if f == "rank" else 0)
                     for f, col in zip(PieceTable.__slots__, out)))
    if not with_boxes:
        return table, None
    # Boxes of the distinct ranks' rows; the rows of a block's first use come before any
    # later use, so a box's first row among the blocks maps to its first row in the table.
    cat = np.concatenate(blocks, axis=1) if blocks else np.zeros((10, 0), dtype=np.int64)
    first, of = unique_columns(list(cat[1:6]))
    del cat
    lens = np.array([b.shape[1] for b in blocks], dtype=np.int64)
    cstart = np.cumsum(lens) - lens
    first = first + np.repeat(starts[made] - cstart, lens)[first]
    of = np.concatenate([of[cstart[b]:cstart[b] + lens[b]] for b in used]) if used else of
    return table, Boxes(of=of if times == 1 else Repeated(of, times), first=first)


_NARROW = np.iinfo(np.int32).max


def _column_dtype(blocks: list[np.ndarray], ranks: int) -> np.dtype:
    """int32 when every value, and every element offset or box size made from a row, fits
    in it (element offsets `base + i0*a0 + i1*a1` within the box, and every partial sum,
    are bounded by `|base| + (off0+size0)*|a0| + (off1+size1)*|a1|`): the passes' products
    of two columns then never overflow. Else int64. Rows are `(region, *row)` blocks."""
    bound = ranks
    for b in blocks:
        if b.shape[1] == 0:
            continue
        _, _, off0, off1, size0, size1, base, a0, a1, _ = b
        reach = np.abs(base) + (off0 + size0) * np.abs(a0) + (off1 + size1) * np.abs(a1)
        bound = max(bound, int(np.abs(b).max()), int(reach.max()), int((size0 * size1).max()))
    return np.dtype(np.int32 if bound <= _NARROW else np.int64)


def _rank_rows(tensors: tuple[PhysicalTensor, ...], tensor_id: dict[str, int],
               cache: dict[int, Any]) -> np.ndarray:
    """(region, *row) of every piece of one rank's tensors, as 10 rows of columns."""
    parts: list[np.ndarray] = []
    rows: list[tuple[int, ...]] = []  # of tensors of a few pieces, made in Python
    regions: list[int] = []
    get, geometry = cache.get, cache.setdefault(_GEOMETRY, {})

    def flush() -> None:
        if rows:
            parts.append(np.concatenate([np.array(regions, dtype=np.int64)[None],
                                         np.array(rows, dtype=np.int64).T]))
            rows.clear()
            regions.clear()

    for region, pt in enumerate(tensors):
        got = get(id(pt))
        if got is None:
            got = cache[id(pt)] = _column_rows(pt, tensor_id, cache) \
                if type(pt.pieces) is PieceColumns else \
                _tensor_rows(pt, tensor_id, geometry)
        if type(got) is list:
            rows += got
            regions += [region] * len(got)
        else:
            flush()
            parts.append(np.concatenate([np.full((1, got.shape[1]), region, np.int64), got]))
    flush()
    return np.concatenate(parts, axis=1) if parts else np.zeros((10, 0), dtype=np.int64)


_GEOMETRY = -1
"""`_rank_rows`' cache key of the strides and dtype code of each (shape, dtype) (an `id` is
never negative)."""
_CODES = {name: code for code, name in enumerate(DTYPE_CODES)}


def _tensor_rows(pt: PhysicalTensor, tensor_id: dict[str, int],
                 geometry: dict[tuple[tuple[int, ...], str], tuple[tuple[int, ...], int]]
                 | None = None) -> list[tuple[int, ...]]:
    """(tensor, off0, off1, size0, size1, base, a0, a1, dtype) of each piece; 1-d (and
    0-d) boxes as `[n, 1]`. `geometry`: the row-major strides (in elements) and dtype code
    of each (shape, dtype) seen, kept between calls (the ranks of a sharded model hold
    many tensors of one shape)."""
    key = (pt.shape, pt.dtype)
    known = None if geometry is None else geometry.get(key)
    if known is None:
        shape, nd = pt.shape, len(pt.shape)
        strides = [1] * nd
        for d in range(nd - 1, 0, -1):
            strides[d - 1] = strides[d] * shape[d]
        known = (tuple(strides), _CODES[pt.dtype])
        if geometry is not None:
            geometry[key] = known
    strides, code = known
    rows = []
    for p in pt.pieces:
        tid = tensor_id.get(p.tensor)
        if tid is None:
            _unknown(pt, p.tensor)
        off, size, at, dims = p.offsets, p.sizes, p.at, p.dims
        k = len(size)
        if dims is None:
            dims = range(len(at) - k, len(at))
        if k >= 2:
            o0, o1, s0, s1, a0, a1 = off[0], off[1], size[0], size[1], strides[dims[0]], \
                strides[dims[1]]
        elif k == 1:
            o0, o1, s0, s1, a0, a1 = off[0], 0, size[0], 1, strides[dims[0]], 1
        else:
            o0, o1, s0, s1, a0, a1 = 0, 0, 1, 1, 1, 1
        base = sum(map(mul, at, strides)) - o0 * a0 - o1 * a1
        rows.append((tid, o0, o1, s0, s1, base, a0, a1, code))
    return rows


def _unknown(pt: PhysicalTensor, name: str) -> None:
    raise ValueError(f"layout: {pt.name} holds a piece of {name!r}, which is not in the "
                     "model spec")


def _column_rows(pt: PhysicalTensor, tensor_id: dict[str, int], cache: dict[int, Any]
                 ) -> np.ndarray:
    """`_tensor_rows` of a `PieceColumns` tensor, from its columns, as 9 rows."""
    c = pt.pieces
    assert isinstance(c, PieceColumns)
    ids = cache.get(id(c.names))
    if ids is None:  # names shared by many ranks' columns are looked up once
        ids = cache[id(c.names)] = [tensor_id.get(name, -1) for name in c.names]
    if -1 in ids:
        _unknown(pt, c.names[ids.index(-1)])
    n, k = len(c), c.offsets.shape[1]
    rows = np.empty((9, n), dtype=np.int64)
    if n == 0:
        return rows
    dims = c.dims if c.dims is not None else tuple(range(c.at.shape[1] - k, c.at.shape[1]))
    strides = np.array([math.prod(pt.shape[d + 1:]) for d in range(len(pt.shape))],
                       dtype=np.int64)
    a = ([int(strides[d]) for d in dims] + [1, 1])[:2]  # 1-d (and 0-d) boxes: [n, 1]
    rows[0] = ids
    rows[1] = c.offsets[:, 0] if k > 0 else 0
    rows[2] = c.offsets[:, 1] if k > 1 else 0
    rows[3] = c.sizes[:, 0] if k > 0 else 1
    rows[4] = c.sizes[:, 1] if k > 1 else 1
    rows[5] = (c.at @ strides if len(strides) else 0) - rows[1] * a[0] - rows[2] * a[1]
    rows[6], rows[7] = a
    rows[8] = DTYPE_CODES.index(pt.dtype)
    return rows


@dataclass(frozen=True, slots=True)
class Boxes:
    """The distinct boxes (tensor, off0, off1, size0, size1) of a piece table's rows, in
    that sorted order: `of[row]` is the box of each row, `first[box]` its first row."""

    of: np.ndarray
    first: np.ndarray


def boxes(t: PieceTable) -> Boxes:
    """The distinct boxes of `t`'s rows (one sort of the rows)."""
    first, of = unique_columns([t.tensor, t.off0, t.off1, t.size0, t.size1])
    return Boxes(of=of, first=first)


def keep_boxes(b: Boxes, keep: np.ndarray) -> Boxes:
    """The boxes of the rows `keep` (a mask that keeps or drops each box whole), for the
    table `take(t, np.nonzero(keep)[0])`: no sort."""
    kept = keep[b.first]
    box = np.cumsum(kept) - 1
    row = np.cumsum(keep) - 1
    return Boxes(of=box[b.of[keep]], first=row[b.first[kept]])


def _unique_boxes(t: PieceTable, b: Boxes | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(box id of each row, the box of each unique box as (tensor, off0, off1, size0,
    size1) rows); boxes sorted. `b`: `boxes(t)`, when known."""
    b = boxes(t) if b is None else b
    f = b.first
    return b.of, np.stack([t.tensor[f], t.off0[f], t.off1[f], t.size0[f], t.size1[f]], axis=1)


def intersect(spec: ModelSpec, src: PieceTable, dst: PieceTable,
              dst_boxes: Boxes | None = None, pairs: Chunks | None = None) -> Chunks:
    """Cut every target piece by the source boxes it overlaps; check exact coverage.
    `dst_boxes`: `boxes(dst)`, when the caller has it (`route` does). `pairs`: `join(spec,
    src, dst, dst_boxes)`, when the caller has it (`route` does: the join is not made
    again; `dst_boxes` then given too)."""
    if pairs is None:
        tbox_of, tboxes = _unique_boxes(dst, dst_boxes)
        pairs = _join(spec, src, dst, tbox_of, tboxes)
        n_boxes = len(tboxes)
    else:
        assert dst_boxes is not None
        tbox_of, n_boxes = dst_boxes.of, len(dst_boxes.first)
    tb, sb = pairs.dst, pairs.sbox
    if np.array_equal(tb, np.arange(n_boxes)):  # one source box each: all of it (coverage)
        return Chunks(tensor=dst.tensor, off0=dst.off0, off1=dst.off1, size0=dst.size0,
                      size1=dst.size1, dst=np.arange(len(dst), dtype=_index_dtype(len(dst))),
                      sbox=sb[tbox_of],
                      holder_ptr=pairs.holder_ptr, holders=pairs.holders)
    # Expand box pairs (grouped by tbox, as `tb` is sorted) to every target piece row.
    pair_ptr = np.zeros(n_boxes + 1, dtype=np.int64)
    np.cumsum(np.bincount(tb, minlength=n_boxes), out=pair_ptr[1:])  # (searchsorted's)
    per_row = pair_ptr[tbox_of + 1] - pair_ptr[tbox_of]
    rows = np.repeat(np.arange(len(dst)), per_row)
    first = np.repeat(np.cumsum(per_row) - per_row, per_row)
    pair = np.repeat(pair_ptr[tbox_of], per_row) + (np.arange(len(rows)) - first)
    del first
    return Chunks(tensor=pairs.tensor[pair], off0=pairs.off0[pair], off1=pairs.off1[pair],
                  size0=pairs.size0[pair], size1=pairs.size1[pair], dst=rows, sbox=sb[pair],
                  holder_ptr=pairs.holder_ptr, holders=pairs.holders)


def join(spec: ModelSpec, src: PieceTable, dst: PieceTable, dst_boxes: Boxes | None = None
         ) -> Chunks:
    """`intersect` of the distinct boxes of `dst` (`dst_boxes`: `boxes(dst)`, when known):
    each box's chunks, `dst` its box id (sorted); coverage checked."""
    return _join(spec, src, dst, *_unique_boxes(dst, dst_boxes))


def keep_pairs(pairs: Chunks, keep: np.ndarray) -> Chunks:
    """The `join` pairs of the boxes `keep` (a mask of the box ids), renumbered as
    `keep_boxes` does."""
    box = np.cumsum(keep) - 1
    mask = keep[pairs.dst]
    return Chunks(tensor=pairs.tensor[mask], off0=pairs.off0[mask], off1=pairs.off1[mask],
                  size0=pairs.size0[mask], size1=pairs.size1[mask],
                  dst=box[pairs.dst[mask]], sbox=pairs.sbox[mask],
                  holder_ptr=pairs.holder_ptr, holders=pairs.holders)


def _join(spec: ModelSpec, src: PieceTable, dst: PieceTable, tbox_of: np.ndarray,
          tboxes: np.ndarray) -> Chunks:
    """Cross join of the unique target boxes `tboxes` with the unique source boxes of the
    same tensor: the overlapping pairs, grouped by target box (`join`)."""
    sbox_of, sboxes = _unique_boxes(src)
    s_start = np.searchsorted(sboxes[:, 0], tboxes[:, 0], side="left")
    s_end = np.searchsorted(sboxes[:, 0], tboxes[:, 0], side="right")
    counts = s_end - s_start
    tb = np.repeat(np.arange(len(tboxes)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    sb = np.repeat(s_start, counts) + (np.arange(len(tb)) - first)
    lo0 = np.maximum(tboxes[tb, 1], sboxes[sb, 1])
    lo1 = np.maximum(tboxes[tb, 2], sboxes[sb, 2])
    hi0 = np.minimum(tboxes[tb, 1] + tboxes[tb, 3], sboxes[sb, 1] + sboxes[sb, 3])
    hi1 = np.minimum(tboxes[tb, 2] + tboxes[tb, 4], sboxes[sb, 2] + sboxes[sb, 4])
    keep = (hi0 > lo0) & (hi1 > lo1)
    if not keep.all():  # (else no copies)
        tb, sb, lo0, lo1, hi0, hi1 = (x[keep] for x in (tb, sb, lo0, lo1, hi0, hi1))
    del keep, first
    hi0 -= lo0  # the chunks' sizes
    hi1 -= lo1
    _check_coverage(spec, tboxes, tb, hi0 * hi1, dst, tbox_of)
    holders = stable_argsort(sbox_of).astype(_index_dtype(len(src)))
    holder_ptr = np.searchsorted(sbox_of[holders], np.arange(len(sboxes) + 1))
    sb = sb.astype(_index_dtype(len(sboxes)))  # (a chunk's source box: an index too)
    return Chunks(tensor=tboxes[tb, 0], off0=lo0, off1=lo1, size0=hi0, size1=hi1,
                  dst=tb, sbox=sb, holder_ptr=holder_ptr, holders=holders)


def _index_dtype(n: int) -> np.dtype:
    """Row numbers of a table of `n` rows: int32 where they fit (the chunks' `dst` and
    `sbox`, the holders and hence `assign`'s choice: only ever indices)."""
    return np.dtype(np.int32 if n <= _NARROW else np.int64)


def _check_coverage(spec: ModelSpec, tboxes: np.ndarray, tb: np.ndarray, numel: np.ndarray,
                    dst: PieceTable, tbox_of: np.ndarray) -> None:
    covered = np.bincount(tb, weights=numel.astype(np.float64), minlength=len(tboxes))
    want = (tboxes[:, 3] * tboxes[:, 4]).astype(np.float64)
    bad = np.nonzero(covered != want)[0]
    if len(bad):
        b = tboxes[bad[0]]
        row = int(np.nonzero(tbox_of == bad[0])[0][0])
        name = spec.tensors[b[0]].name
        what = "covers only" if covered[bad[0]] < want[bad[0]] else "covers overlapping"
        raise ValueError(
            f"intersect: the source layout {what} {int(covered[bad[0]])} of "
            f"{int(want[bad[0]])} elements of {name} box offsets=({b[1]}, {b[2]}) "
            f"sizes=({b[3]}, {b[4]}) that target rank {int(dst.rank[row])} needs; the "
            "source and target configs must describe the same model (and source replicas "
            "must shard each tensor the same way)")


def element_size(code: np.ndarray) -> np.ndarray:
    return ITEM[code]


class Repeated(np.lib.mixins.NDArrayOperatorsMixin):
    """A column that is `one` repeated `times` times, copy k plus `k * step` (a replica's
    target ranks move by `step`; its other columns equal the first replica's): indexed like
    the whole column (an index array or a slice gives a new array), never held whole but
    while a numpy function or operator reads it whole (`__array__`: made for that call)."""

    __slots__ = ("one", "times", "step")

    def __init__(self, one: np.ndarray, times: int, step: int = 0) -> None:
        self.one, self.times, self.step = one, times, step

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.tile(self.one, self.times)
        if self.step:
            out.reshape(self.times, -1)[:] += (np.arange(self.times, dtype=out.dtype)
                                               * out.dtype.type(self.step))[:, None]
        return out if dtype is None else out.astype(dtype, copy=False)

    def _part(self, k: int, lo: int, hi: int) -> np.ndarray:
        """Rows `lo:hi` of copy `k`."""
        part = self.one[lo:hi]
        return part + self.one.dtype.type(k * self.step) if self.step and k else part

    def _ascending(self, which: np.ndarray) -> np.ndarray:
        """The rows `which` (ascending, each a row of the column) of the whole column."""
        n = len(self.one)
        cut = np.searchsorted(which, n * np.arange(self.times + 1)).tolist()
        out = np.empty(len(which), dtype=self.one.dtype)
        for k, (lo, hi) in enumerate(zip(cut[:-1], cut[1:])):
            if hi > lo:
                np.take(self.one, which[lo:hi] - k * n, out=out[lo:hi])
                if self.step and k:
                    out[lo:hi] += self.one.dtype.type(k * self.step)
        return out

    def copies(self) -> Iterator[np.ndarray]:
        """The column, one copy at a time (`one`, then `one + step`, ...)."""
        for k in range(self.times):
            yield self._part(k, 0, len(self.one))

    def min(self, axis: Any = None, out: Any = None, **kw: Any) -> Any:
        if axis is not None or out is not None or kw or len(self) == 0:
            return np.asarray(self).min(axis=axis, out=out, **kw)
        return self.one.min() + min(0, self.step * (self.times - 1))

    def max(self, axis: Any = None, out: Any = None, **kw: Any) -> Any:
        if axis is not None or out is not None or kw or len(self) == 0:
            return np.asarray(self).max(axis=axis, out=out, **kw)
        return self.one.max() + max(0, self.step * (self.times - 1))

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        args = [np.asarray(x) if isinstance(x, Repeated) else x for x in inputs]
        return getattr(ufunc, method)(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.one) * self.times

    @property
    def dtype(self) -> np.dtype:
        return self.one.dtype

    def __getitem__(self, which: np.ndarray | slice) -> np.ndarray:
        n = len(self.one)
        if isinstance(which, slice):
            lo, hi, by = which.indices(len(self))
            if by == 1 and hi <= lo:
                return self.one[:0].copy()
            if by == 1:  # each copy's part of it (a view where it lies within one copy)
                parts = [self._part(k, max(lo - k * n, 0), min(hi - k * n, n))
                         for k in range(lo // n, (hi - 1) // n + 1)]
                return parts[0] if len(parts) == 1 else np.concatenate(parts)
            which = np.arange(lo, hi, by)
        which = np.asarray(which)
        if which.dtype == bool:
            which = np.flatnonzero(which)
        if which.ndim == 1 and len(which) and which.dtype.kind in "iu" \
                and 0 <= which.min() and which.max() < len(self):
            if which.max() < n:
                return self.one[which]  # (all in the first copy)
            if not (which[1:] < which[:-1]).any():  # ascending: each copy's run of them,
                return self._ascending(which)  # by search (no division)
        k, i = np.divmod(which, n)
        out = self.one[i]
        if self.step:
            out += (k * self.step).astype(out.dtype)
        return out


def alike(dst: PieceTable, times: int) -> int:
    """The rows of each of `times` equal blocks of `dst` (every column equal to the first
    block's but the target ranks, moved by one step a block): the pieces of the engine's
    alike replicas. 0 where there are not `times` >= 2 such blocks."""
    if times < 2 or len(dst) % times or len(dst) == 0:
        return 0
    n = len(dst) // times
    if all(isinstance(c, Repeated) and c.times == times for c in _columns(dst)):
        return n  # so made (`table_and_boxes`)
    step = int(dst.rank[n]) - int(dst.rank[0])
    for f in PieceTable.__slots__:
        col, by = getattr(dst, f), step if f == "rank" else 0
        if not _blocks_equal(col, n, times, by):
            return 0
    return n


def _blocks_equal(col: np.ndarray, n: int, times: int, by: int) -> bool:
    """Whether block k of `col` (`n` rows each) is the first block plus `k * by`."""
    first = col[:n]
    for k in range(1, times):
        block = col[k * n:(k + 1) * n]
        if not np.array_equal(block - by * k if by else block, first):
            return False
    return True


def first_block(dst: PieceTable, b: Boxes, n: int) -> tuple[PieceTable, Boxes]:
    """The first `n` rows of `dst` (views) and their boxes, for `dst` of blocks `alike`
    (every box's first row is in the first block; the boxes keep their ids)."""
    return (PieceTable(*(getattr(dst, f)[:n] for f in PieceTable.__slots__)),
            Boxes(of=b.of[:n], first=b.first))


_CUT = ("tensor", "off0", "off1", "size0", "size1", "dst", "sbox")
"""The chunks' columns that repeat with the replicas (the source boxes only while kept)."""


def repeat_block(chunks: Chunks, dst: PieceTable, times: int) -> tuple[Chunks, PieceTable]:
    """The chunks of the first block of `dst` (blocks `alike`, each of `len(dst) // times`
    rows: the first block's chunks, its target rows moved by the block's rows, are each
    other block's) and `dst`, as `Repeated` columns of the first block (each its own
    small array: the whole columns can go)."""
    n = len(dst) // times
    step = int(dst.rank[n]) - int(dst.rank[0])
    cut = _CUT if len(chunks.sbox) else _CUT[:-1]
    return (Chunks(**{f: Repeated(_own(getattr(chunks, f)), times, n if f == "dst" else 0)
                      for f in cut},
                   **({} if "sbox" in cut else {"sbox": chunks.sbox}),
                   holder_ptr=chunks.holder_ptr, holders=chunks.holders),
            PieceTable(**{f: _repeated(getattr(dst, f), times, step if f == "rank" else 0)
                          for f in PieceTable.__slots__}))


def _repeated(col: np.ndarray, times: int, step: int) -> Repeated:
    """`col`, `times` blocks alike (each the first plus `step` a block), as `Repeated`."""
    if isinstance(col, Repeated) and col.times == times:
        return col
    return Repeated(_own(col[:len(col) // times]), times, step)


def _columns(t: PieceTable) -> list[np.ndarray]:
    return [getattr(t, f) for f in PieceTable.__slots__]


def _own(col: np.ndarray) -> np.ndarray:
    """`col` read-only, as an array of its own (a view is copied: the whole column can
    go)."""
    out = col if col.base is None else np.array(col)
    out.flags.writeable = False
    return out
