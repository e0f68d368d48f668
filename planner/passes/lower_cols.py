"""The typed columns `lower` passes between its steps (`planner/passes/lower.py`).

- `Chosen`: the chunks with their chosen source rows and both sides' piece tables: what
  every step reads (and `assign`, `egress_sets` and the explain rows, through the same
  reads of alike replicas' copies); `At`: a selection of its chunks, resolved once;
- `Rows`, `Geometry`: chunks as 2-d boxes `s0 x s1` (a box `n x 1` read as `1 x n`), with
  strides, dtype codes and copy needs (`shape`); `Rows` is the part a direct write reads;
- `Writes`: byte writes as columns (`writes` makes the direct ones);
- `Placed`: the staged chunks in placement order, with their stage and staging offsets;
  `copies` makes their PACK and UNPACK copy columns from it and their `Geometry`.

Each container is a frozen record of numpy columns of one length (one row per chunk, or
per write), as `schemas.Table` is for the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from planner.passes.intersect import Chunks, PieceTable, Repeated, element_size
from planner.rows import smallest_int
from schemas.plan import COPY_COLUMNS, PACK, UNPACK

Index = np.ndarray | slice
"""Which chunks: an index array, or a slice (a block of the chunk table)."""


@dataclass(frozen=True, slots=True)
class At:
    """Chunks of a `Chosen`, resolved once for every column read of them (`Chosen.at`): their
    rows in the chunk columns and in the target piece columns as stored (a `Repeated`
    column's first copy; a slice where they are a block of one copy), the copy of the
    alike replicas each lies in (an int where they lie in one), and their chosen source
    piece rows. Row numbers are `np.intp`: numpy casts any other index to it on each read."""

    chunk: Index
    dst: Index
    copy: np.ndarray | int
    src: np.ndarray | None
    """None where no source is chosen yet (`Chosen.choice` None)."""

    def __len__(self) -> int:
        c = self.chunk
        return c.stop - c.start if isinstance(c, slice) else len(c)

    def take(self, rows: np.ndarray | slice) -> At:
        """The chunks `rows` of these (an index array, or a slice), in that order."""
        if isinstance(rows, slice) and rows == slice(None):
            return self
        chunk = _index(self.chunk)[rows]
        return At(chunk=chunk, dst=chunk if self.dst is self.chunk else _index(self.dst)[rows],
                  copy=self.copy if isinstance(self.copy, int) else self.copy[rows],
                  src=None if self.src is None else self.src[rows])


def _index(rows: Index) -> np.ndarray:
    """`rows` as an index array (a slice's `arange`)."""
    if isinstance(rows, slice):
        return np.arange(rows.start, rows.stop, dtype=np.intp)
    return rows


@dataclass(frozen=True, slots=True)
class Chosen:
    """Chunks (`chunks.dst`: their target piece rows) and the source piece row chosen for
    each (`choice`), with the source and target piece tables. Columns of alike replicas
    held once (`intersect.Repeated`, chunks and target pieces together) are read through
    their first copy: a chunk's copy and row in it are found once per `At`, not once per
    column read (`at`)."""

    chunks: Chunks
    choice: np.ndarray | None
    """None: no source chosen yet (only the chunk and target columns are read)."""
    src: PieceTable
    dst: PieceTable
    per_copy: int
    """Chunks of each copy (all of them where the columns are not `Repeated`)."""
    dst_is_row: bool = False
    """Chunk k of a copy is target piece row k of it (`chunks.dst` is `arange`: every target
    piece fed by one source box, `intersect`): `At.dst` is then `At.chunk`, no gather."""

    def at(self, which: Index) -> At:
        """Chunks `which`: a slice, or row numbers in ascending order."""
        m, n = self.per_copy, len(self.chunks)
        copy: np.ndarray | int = 0
        if isinstance(which, slice):
            lo, hi, _ = which.indices(n)
            hi = max(hi, lo)
            k = lo // m if m else 0
            if hi <= (k + 1) * m or m == n:  # a block of one copy: views
                chunk: Index = slice(lo - k * m, hi - k * m)
                return At(chunk=chunk, dst=chunk if self.dst_is_row else
                          _stored(self.chunks.dst)[chunk].astype(np.intp),
                          copy=k, src=self._choice(which))
            which = np.arange(lo, hi, dtype=np.intp)
        which = np.asarray(which, dtype=np.intp)
        if m == n or len(which) == 0:
            chunk = which
        elif which[0] // m == which[-1] // m:  # ascending: all in one copy
            copy = int(which[0]) // m
            chunk = which - copy * m if copy else which
        else:  # where each copy's rows start, by search (ascending): no division
            cut = np.searchsorted(which, m * np.arange(n // m + 1))
            copy = np.repeat(np.arange(n // m, dtype=np.int32), np.diff(cut))
            chunk = which - copy.astype(np.intp) * m
        return At(chunk=chunk, dst=chunk if self.dst_is_row else
                  _stored(self.chunks.dst)[chunk].astype(np.intp), copy=copy,
                  src=self._choice(which))

    def _choice(self, which: Index) -> np.ndarray | None:
        return None if self.choice is None else self.choice[which].astype(np.intp)

    def blocks(self, size: int) -> list[slice]:
        """The chunk table as slices of at most `size` rows, none across two copies."""
        m, n = self.per_copy, len(self.chunks)
        return [slice(k + lo, k + min(lo + size, m)) for k in range(0, n, m)
                for lo in range(0, m, size)] if m else []

    def chunk(self, name: str, a: At) -> np.ndarray:
        """Chunk column `name` of the chunks `a`."""
        return _stored(getattr(self.chunks, name))[a.chunk]

    def target(self, name: str, a: At) -> np.ndarray:
        """Target piece column `name` of the chunks `a`."""
        col = getattr(self.dst, name)
        out = _stored(col)[a.dst]
        step = col.step if isinstance(col, Repeated) else 0
        if not step:
            return out
        if isinstance(a.copy, int):  # copy k of a column is its first plus `k * step`
            return out + out.dtype.type(a.copy * step) if a.copy else out
        return out + a.copy.astype(out.dtype) * out.dtype.type(step)

    def source(self, name: str, a: At) -> np.ndarray:
        """Source piece column `name` of the chunks `a` (their chosen rows)."""
        assert a.src is not None
        return getattr(self.src, name)[a.src]

    def start(self, a: At, source: bool) -> np.ndarray:
        """Element offset of the first element of chunks `a` on the source side (or the
        target side)."""
        side = self.source if source else self.target
        return side("base", a) + self.chunk("off0", a) * side("a0", a) + \
            self.chunk("off1", a) * side("a1", a)


def _stored(col: np.ndarray) -> np.ndarray:
    """A column's values as stored: a `Repeated` column's first copy."""
    return col.one if isinstance(col, Repeated) else col


def chosen(chunks: Chunks, choice: np.ndarray | None, src: PieceTable, dst: PieceTable
           ) -> Chosen:
    """The `Chosen` of the chunks, with their copies of alike replicas where the chunks and
    the target pieces are `Repeated` alike (`intersect.repeat_block`)."""
    per_copy = len(chunks)
    if isinstance(chunks.tensor, Repeated):
        times = chunks.tensor.times
        assert all(isinstance(getattr(chunks, f), Repeated) and getattr(chunks, f).times
                   == times for f in ("tensor", "off0", "off1", "size0", "size1", "dst"))
        assert all(isinstance(getattr(dst, f), Repeated) and getattr(dst, f).times == times
                   for f in PieceTable.__slots__)
        per_copy = len(chunks) // times
        n = len(dst) // times
        one = chunks.dst.one
        is_row = per_copy == n and (n == 0 or (int(one[0]) == 0 and bool(
            (np.diff(one) == 1).all())))
    else:
        is_row = row_per_chunk(chunks, dst)
    return Chosen(chunks, choice, src, dst, per_copy, is_row)


def row_per_chunk(chunks: Chunks, dst: PieceTable) -> bool:
    """Whether chunk k is target piece row k for every k (`Chosen.dst_is_row`)."""
    n = len(dst)
    return len(chunks) == n and (n == 0 or (int(chunks.dst[0]) == 0 and bool(
        (np.diff(chunks.dst) == 1).all())))


@dataclass(frozen=True, slots=True)
class Rows:
    """What a direct write reads of its chunks: the 2-d boxes' sizes (`s0` rows of `s1`),
    the row strides and the target element size (the source's: a direct write casts
    nothing)."""

    s0: np.ndarray
    s1: np.ndarray
    s_a0: np.ndarray
    d_a0: np.ndarray
    es_d: np.ndarray


@dataclass(frozen=True, slots=True)
class Geometry(Rows):
    """`Rows` plus the source dtype code, the inner strides, the target dtype code, the
    bytes, whether each side is contiguous, whether the chunk is packed or unpacked if
    staged, and whether it must be (no direct write can do it: a cast or a strided row)."""

    s_code: np.ndarray
    s_a1: np.ndarray
    d_a1: np.ndarray
    d_code: np.ndarray
    nbytes: np.ndarray
    s_contig: np.ndarray
    d_contig: np.ndarray
    pack: np.ndarray
    unpack: np.ndarray
    staged: np.ndarray


def shape(c: Chosen, a: At) -> Geometry:
    """The `Geometry` of chunks `a`."""
    s0, s1 = c.chunk("size0", a), c.chunk("size1", a)
    col = s1 == 1  # read `n x 1` as `1 x n`
    s_a0, d_a0 = c.source("a0", a), c.target("a0", a)
    s_a1 = np.where(col, s_a0, c.source("a1", a))
    d_a1 = np.where(col, d_a0, c.target("a1", a))
    s0, s1 = np.where(col, 1, s0), np.where(col, s0, s1)
    s_code, d_code = c.source("dtype", a), c.target("dtype", a)
    es_d = element_size(d_code)
    one_row = s0 == 1
    s_contig = (s_a1 == 1) & (one_row | (s_a0 == s1))
    d_contig = (d_a1 == 1) & (one_row | (d_a0 == s1))
    cast = s_code != d_code
    return Geometry(s0=s0, s1=s1, s_a0=s_a0, d_a0=d_a0, es_d=es_d, s_code=s_code,
                    s_a1=s_a1, d_a1=d_a1, d_code=d_code, nbytes=s0 * s1 * es_d,
                    s_contig=s_contig, d_contig=d_contig, pack=cast | ~s_contig,
                    unpack=~d_contig, staged=cast | (s_a1 != 1) | (d_a1 != 1))


def direct_rows(c: Chosen, a: At) -> Rows:
    """The `Rows` of chunks `a` that are not staged (unit inner strides on both sides and
    no cast, so one element size): only what a direct write reads."""
    s0, s1 = c.chunk("size0", a), c.chunk("size1", a)
    col = s1 == 1  # read `n x 1` as `1 x n`
    return Rows(s0=np.where(col, 1, s0), s1=np.where(col, s0, s1), s_a0=c.source("a0", a),
                d_a0=c.target("a0", a), es_d=element_size(c.target("dtype", a)))


def rows_per_write(s0: np.ndarray, s1: np.ndarray, s_a0: np.ndarray, d_a0: np.ndarray
                   ) -> np.ndarray:
    """Direct writes of each chunk (of `shape`'s 2-d boxes): one, when both sides are
    contiguous (or it is one row), else one per row."""
    return np.where((s_a0 == s1) & (d_a0 == s1) | (s0 == 1), 1, s0)


@dataclass(frozen=True, slots=True)
class Writes:
    """Byte writes as columns: from (rank, region, byte offset) to (rank, region, byte
    offset), `nbytes` each, in `stage` (None: not decided yet)."""

    src_rank: np.ndarray
    src_region: np.ndarray
    src_offset: np.ndarray
    dst_rank: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray
    stage: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.nbytes)

    def columns(self) -> dict[str, np.ndarray]:
        """The columns by `Lowered`'s names (`w_` and the field), those that are set."""
        return {f"w_{f.name}": v for f in dataclasses.fields(self)
                if (v := getattr(self, f.name)) is not None}

    def repeat(self, src: int, at: int, n: int, name: str, by: int) -> int:
        """Copy rows `src:src + n` of these columns that are set to rows `at:at + n`, column
        `name` plus `by`; returns the row after them."""
        for f in dataclasses.fields(self):
            if (v := getattr(self, f.name)) is not None:
                v[at:at + n] = v[src:src + n]
                if f.name == name and by:
                    v[at:at + n] += v.dtype.type(by)
        return at + n

    def put(self, at: int, part: Writes) -> int:
        """Copy the columns `part` has into these, from row `at`; returns the row after
        them."""
        n = len(part)
        for f in dataclasses.fields(self):
            if (v := getattr(part, f.name)) is not None:
                getattr(self, f.name)[at:at + n] = v
        return at + n


def writes(c: Chosen, g: Rows, di: np.ndarray | None, a: At,
           dst_offset: np.ndarray | None = None) -> Writes:
    """Direct writes of the chunks `a.take(di)` (`g`: the `Rows` of `a`; `di` None: all of
    them): one per row, or the whole box when both sides are contiguous. Ranks and regions
    in the piece tables' dtype; offsets in bytes of the target's element size, which is the
    source's (no cast). `dst_offset`: the writes' target offsets, when known (those of the
    same chunks of another copy of alike replicas)."""
    sel = slice(None) if di is None else di  # (a slice takes views, not copies)
    s0, s1 = g.s0[sel], g.s1[sel]
    r = rows_per_write(s0, s1, g.s_a0[sel], g.d_a0[sel])
    whole = r == 1  # (a chunk of rows that are not whole has more than one row)
    one = bool(whole.all())  # one write per chunk: no row expansion
    idx = sel if one else np.repeat(np.arange(len(a)) if di is None else di, r)
    at = a.take(idx)
    s_off = c.start(at, source=True)
    d_off = c.start(at, source=False) if dst_offset is None else None
    if not one:  # row k of a chunk: k strides on
        k = np.arange(len(at)) - np.repeat(np.cumsum(r) - r, r)
        s_off = s_off + k * g.s_a0[idx]
        if d_off is not None:
            d_off = d_off + k * g.d_a0[idx]
    es = g.es_d[idx]
    nbytes = np.where(whole, s0 * s1, s1) * g.es_d[sel]
    return Writes(src_rank=c.source("rank", at), src_region=c.source("region", at),
                  src_offset=s_off * es, dst_rank=c.target("rank", at),
                  dst_region=c.target("region", at),
                  dst_offset=d_off * es if d_off is not None else dst_offset,
                  nbytes=nbytes if one else np.repeat(nbytes, r))


@dataclass(frozen=True, slots=True)
class Placed:
    """The staged chunks in placement order: each one's stage, its byte offset in the
    source's staging (`s_soff`, where packed) and the target's (`d_soff`, where unpacked),
    its ranks and tensor regions, and its first element on each side (`s_start`,
    `d_start`)."""

    stage: np.ndarray
    s_soff: np.ndarray
    d_soff: np.ndarray
    src_rank: np.ndarray
    dst_rank: np.ndarray
    s_region: np.ndarray
    d_region: np.ndarray
    s_start: np.ndarray
    d_start: np.ndarray


def copies(g: Geometry, at: Placed, n_regions: np.ndarray) -> dict[str, np.ndarray]:
    """PACK copies (on sources) then UNPACK copies (on targets) of the staged chunks (`g`
    and `at` over them in placement order; `n_regions[rank]`: the rank's staging region):
    `schemas.plan.COPY_COLUMNS` plus `rank`, int64 columns as int32 where they fit, and
    those but `rank` as int16 or int8 where they fit (`_smaller`)."""
    (p, n_p), (u, n_u) = _rows(g.pack), _rows(g.unpack)
    one_p, one_u = _same(np.int32(1), n_p), _same(np.int32(1), n_u)
    es_d, s1 = g.es_d, g.s1
    cols = {  # each column's (packs, unpacks), made one column at a time
        "rank": lambda: (at.src_rank[p], at.dst_rank[u]),
        "kind": lambda: (_same(np.int64(PACK), n_p), _same(np.int64(UNPACK), n_u)),
        "stage": lambda: (at.stage[p], at.stage[u]),
        "src_region": lambda: (at.s_region[p], n_regions[at.dst_rank[u]]),
        "src_dtype": lambda: (g.s_code[p], g.d_code[u]),
        "src_offset": lambda: (at.s_start[p], at.d_soff[u] // es_d[u]),
        "src_stride0": lambda: (g.s_a0[p], s1[u]),
        "src_stride1": lambda: (g.s_a1[p], one_u),
        "src_stride2": lambda: (one_p, one_u),
        "dst_region": lambda: (n_regions[at.src_rank[p]], at.d_region[u]),
        "dst_dtype": lambda: (g.d_code[p], g.d_code[u]),
        "dst_offset": lambda: (at.s_soff[p] // es_d[p], at.d_start[u]),
        "dst_stride0": lambda: (s1[p], g.d_a0[u]),
        "dst_stride1": lambda: (one_p, g.d_a1[u]),
        "dst_stride2": lambda: (one_p, one_u),
        "size0": lambda: (g.s0[p], g.s0[u]),
        "size1": lambda: (s1[p], s1[u]),
        "size2": lambda: (one_p, one_u),
        "aux_offset": lambda: (_same(np.int32(0), n_p + n_u),),
    }
    return {k: constant(_column(f(), _COPY_DTYPES.get(k, np.dtype(np.int64)), k != "rank"))
            for k, f in cols.items()}


def _same(value: np.generic, n: int) -> np.ndarray:
    """A column of `n` rows of `value` (its dtype), held in one element (`constant`)."""
    return np.broadcast_to(np.asarray(value), (n,))


def _rows(mask: np.ndarray) -> tuple[np.ndarray | slice, int]:
    """The rows `mask` sets (a slice of all where it sets every row: views, no gathers),
    and their number."""
    n = int(np.count_nonzero(mask))
    return (slice(None) if n == len(mask) else np.flatnonzero(mask)), n


def constant(col: np.ndarray) -> np.ndarray:
    """`col`, or, when every value of it is one value, that value as a read-only column of
    `col`'s length held in one element (stride 0, `is_constant`): many copy columns are
    (a dtype, a unit stride, a kind) and they live from `lower` to `emit`."""
    if is_constant(col) or len(col) < 2 or not (col == col[0]).all():
        return col
    return np.broadcast_to(col[:1].copy(), col.shape)


def is_constant(col: np.ndarray) -> bool:
    """Whether `col` is a column `constant` made of one element."""
    return len(col) > 1 and col.strides == (0,)


def as_dtype(col: np.ndarray, dt: np.dtype) -> np.ndarray:
    """`col` in `dt` (itself if it is), a `constant` column kept one."""
    if is_constant(col):
        return np.broadcast_to(col[:1].astype(dt), col.shape)
    return col.astype(dt, copy=False)


def concat(a: np.ndarray, b: np.ndarray, dt: np.dtype | None = None) -> np.ndarray:
    """`np.concatenate([a, b], dtype=dt)`, but a `constant` column stays one when the other
    part is empty or the same constant."""
    dt = np.result_type(a, b) if dt is None else np.dtype(dt)
    if is_constant(a) and (len(b) == 0 or is_constant(b) and b[0] == a[0]) or \
            is_constant(b) and len(a) == 0:
        one = a if len(a) else b
        return np.broadcast_to(one[:1].astype(dt), (len(a) + len(b),))
    return np.concatenate([a, b], dtype=dt)


def _column(parts: tuple[np.ndarray, ...], dt: np.dtype, small: bool = True
            ) -> np.ndarray:
    """The copy column of `parts` (packs', unpacks') in `dt`, but an int64 one as int32
    where its values fit (`_narrow`; parts all of at most 32-bit ints fit as they are),
    and with `small` an int32 or int64 one as int16 or int8 where they fit (`_smaller`); a
    `constant` one where the parts are all of one value, held in one element each (made
    from a row of each: never whole)."""
    n = sum(map(len, parts))
    some = [x for x in parts if len(x)]
    if n > 1 and all(is_constant(x) or len(x) == 1 for x in some) and \
            all(x[0] == some[0][0] for x in some):  # one value: made of one row of each
        return np.broadcast_to(_whole(tuple(x[:1] for x in parts), dt)[:1].copy(), (n,))
    col = _whole(parts, dt)
    return _smaller(col) if small else col


def _smaller(col: np.ndarray) -> np.ndarray:
    """An int32 copy column (int64 ones are int32 where they fit, `_narrow`) as int8 or
    int16 where its values fit (a new array; `emit` casts it back to the plan's dtype): the
    copies are held from `lower` to `emit`, through `coalesce`'s sort."""
    return smallest_int(col) if col.dtype == np.int32 else col


def _whole(parts: tuple[np.ndarray, ...], dt: np.dtype) -> np.ndarray:
    """`_column` of `parts`, made whole."""
    n = sum(map(len, parts))
    if dt == np.int64 and n and (all(
            x.dtype.kind in "iu" and x.dtype.itemsize <= 4 and x.dtype != np.uint32
            for x in parts) or _fits([x for x in parts if len(x)])):  # (no int64 one made)
        return np.concatenate(parts, dtype=np.int32, casting="unsafe")
    return _narrow(np.concatenate(parts, dtype=dt, casting="unsafe"))


def _fits(parts: list[np.ndarray]) -> bool:
    """Whether every value of the integer `parts` fits int32 (`_narrow`)."""
    return all(x.dtype.kind in "iu" and int(x.min()) >= -(1 << 31) and int(x.max()) < 1 << 31
               for x in parts)


def _narrow(col: np.ndarray) -> np.ndarray:
    """An int64 copy column as int32 when its values fit (`emit` casts it back)."""
    if col.dtype != np.int64 or len(col) == 0 or col.min() < -(1 << 31) or \
            col.max() >= 1 << 31:
        return col
    return col.astype(np.int32)


_COPY_DTYPES = {"rank": np.dtype(np.int32), **{n: np.dtype(d) for n, d in COPY_COLUMNS}}
"""Copy columns as the plan holds them (narrow: kinds, dtypes, stages, regions, ranks)."""
