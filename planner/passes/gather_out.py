"""What the gather pass (`gather.py`) builds: each rank's staging, allocated per stage in
two pools (`Staging`), and the writes and copies it emits (`Out`), turned into the
`Lowered` columns the later passes take (`lowered`); `Rows`, the columns it reads row by
row."""

from __future__ import annotations

import numpy as np

from planner.passes.lower import Lowered
from schemas.plan import COPY_COLUMNS, DTYPE_CODES, QUANT
from schemas.protocol import ALIGN, FP8_BLOCK, ITEM, SCALE_BYTES, scale_stride


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    """Bump allocation of each rank's staging per stage, in two pools: pool 0, at most
    `budget - budget // 4` bytes (rounded down to `ALIGN`), for the boxes a rank owns, and
    pool 1, at most the rest, for the parts it packs for other owners (so those packs never
    fall back to row-by-row writes). The budget is a cap: pool 0 starts at byte 0 and is
    as large as its peak; pool 1 starts where pool 0 ends on that rank (`pool1`), known
    once every box is placed, so `take` gives pool-1 offsets from the pool's start."""

    def __init__(self, world: int, budget: int, halves: bool = False) -> None:
        self.used: dict[tuple[int, int, int], int] = {}
        """Pool 0: the end used so far, by (rank, stage, 0)."""
        self.used1: dict[int, np.ndarray] = {}
        """Pool 1: the end used so far on every rank, by stage (`pool1_used`)."""
        split = (budget - budget // 4) // ALIGN * ALIGN
        self.caps = (split, budget - split)
        self.halves = halves
        """Each pool in two halves, even rounds in one, odd rounds in the other
        (`lowered` places them): a round's gather never touches what the round before it
        reads, so its packs run while that round's fan-out is written."""
        if halves:
            self.caps = (split // 2 // ALIGN * ALIGN, (budget - split) // 2 // ALIGN * ALIGN)
        self.world = world
        self.peak0 = [0] * world  # a list: read and set one at a time
        self.peak1 = np.zeros(world, dtype=np.int64)

    def pool1_used(self, stage: int) -> np.ndarray:
        """Pool 1's end on every rank in `stage` (the array itself: to read and set)."""
        used = self.used1.get(stage)
        if used is None:
            used = self.used1[stage] = np.zeros(self.world, dtype=np.int64)
        return used

    def _start(self, rank: int, stages: tuple[int, ...], pool: int) -> int:
        if pool:
            return max(int(self.pool1_used(s)[rank]) for s in stages)
        get = self.used.get
        return max([get((rank, s, 0), 0) for s in stages])

    def fits(self, rank: int, stages: tuple[int, ...], nbytes: int, pool: int = 0) -> bool:
        return self._start(rank, stages, pool) + align(nbytes) <= self.caps[pool]

    def take(self, rank: int, stages: tuple[int, ...], nbytes: int, pool: int = 0) -> int:
        """Offset (from the pool's start) of `nbytes` live in every stage of `stages` on
        `rank`."""
        start = self._start(rank, stages, pool)
        end = start + align(nbytes)
        if pool:
            for s in stages:
                self.pool1_used(s)[rank] = end
            self.peak1[rank] = max(int(self.peak1[rank]), end)
            return start
        for s in stages:
            self.used[(rank, s, 0)] = end
        if end > self.peak0[rank]:
            self.peak0[rank] = end
        return start

    def take_round(self, rank: int, base: int, first: int, nbytes: int) -> tuple[int, int]:
        """In pool 0 on `rank`, `nbytes` in the first round `k` from `first` on whose two
        stages (`base + 2k`, `base + 2k + 1`) both have room; taken (`take`): `(k, its
        offset)`. (`nbytes` at most the pool's cap: else no round has room.)"""
        k = first
        while not self.fits(rank, (base + 2 * k, base + 2 * k + 1), nbytes):
            k += 1
        return k, self.take(rank, (base + 2 * k, base + 2 * k + 1), nbytes)

    @property
    def peak(self) -> np.ndarray:
        """Per rank and pool: the bytes used at the peak."""
        return np.stack([np.array(self.peak0, dtype=np.int64), self.peak1], axis=1)

    @property
    def pool1(self) -> np.ndarray:
        """Per rank: the byte where pool 1 starts."""
        return self.peak[:, 0]

    @property
    def staging(self) -> np.ndarray:
        """Per rank: the staging bytes both pools use at their peaks."""
        return self.peak.sum(axis=1)


FEW_BOXES = 10
"""Boxes (at most) of a round of whole pools below which halves even the owners' fan-out."""
PACK_SHARE = 0.05
"""Share of the fan-out time above which the gathers' pack launches, or the conversions, are
worth overlapping."""


def halves_fit(tboxes: np.ndarray, out_codes: np.ndarray, src_codes: np.ndarray,
               budget: int, owners: int, pack_overhead_s: float, nic_bps: float,
               convert_bps: float = 0.0, fan_out_bps: float = 0.0) -> bool:
    """Whether each pool is split in halves (`Staging`), from the cost model. Each box
    `tboxes` (tensor, off0, off1, size0, size1) needs at most its whole box in the widest
    source dtype `src_codes`, its conversion to `out_codes` and its FP8 scales. Halves
    where every box fits half of pool 0, the boxes need more than one round of whole
    pools spread over `owners` ranks (with one round there is nothing to overlap), and
    either a whole-pool round holds few boxes (`FEW_BOXES`: one box more or less is a
    large share of a round, which waits for its fullest owner) or the gathers' pack
    launches (one a box at least, `pack_overhead_s` each) are over `PACK_SHARE` of the
    time to send the boxes' bytes at `nic_bps` (bytes/s): then overlapping them with the
    round before pays for the extra rounds' boundaries; or converting the boxes (QUANT or a
    casting PACK: their source bytes at `convert_bps`) takes over `PACK_SHARE` of the time
    to send what they become once at `fan_out_bps` (NVLink where every rank shares one
    host, else a NIC): then a round that waits for the round before's fan-out to free its
    staging runs its conversions apart from any write, its owner's link idle meanwhile, and
    halves let them run beside it (FP8: a QUANT reads 2 bytes an element at `pack_gbps`
    while its e4m3 byte goes out at NIC or NVLink rate, 40% of that time or more)."""
    if not len(tboxes) or owners < 1:
        return False
    n0, n1 = tboxes[:, 3], tboxes[:, 4]
    es = int(ITEM[np.unique(src_codes)].max()) if len(src_codes) else 4
    quant = out_codes == DTYPE_CODES.index("float8_e4m3fn")
    out_es = np.where(ITEM[out_codes] != es, ITEM[out_codes], 0)
    need = _align(n0 * n1 * es) + _align(n0 * n1 * out_es) \
        + np.where(quant, _align(-(-n0 // FP8_BLOCK) * -(-n1 // FP8_BLOCK) * SCALE_BYTES), 0)
    pool0 = (budget - budget // 4) // ALIGN * ALIGN
    half = pool0 // 2 // ALIGN * ALIGN
    if need.max() > half or need.sum() <= owners * pool0:
        return False
    few = pool0 < FEW_BOXES * need.mean()
    packs = len(need) * pack_overhead_s > PACK_SHARE * (n0 * n1).sum() * es / nic_bps
    conv = out_es > 0
    converts = bool(conv.any()) and convert_bps > 0 and fan_out_bps > 0 and \
        (n0 * n1)[conv].sum() * es / convert_bps > PACK_SHARE * (
            n0 * n1 * ITEM[out_codes])[conv].sum() / fan_out_bps
    return bool(few or packs or converts)


def _align(n: np.ndarray) -> np.ndarray:
    return -(-n // ALIGN) * ALIGN


class Rows:
    """Some columns of a table as Python lists, for reads of one row at a time (a numpy
    scalar costs far more); each column made on its first read (a gather reads some columns
    of a table row by row, others never: those are never made)."""

    def __init__(self, table: object, columns: tuple[str, ...]) -> None:
        self._table, self._columns = table, columns

    def __getattr__(self, name: str) -> list[int]:
        if name.startswith("_") or name not in self._columns:
            raise AttributeError(name)
        col = getattr(self._table, name).tolist()
        setattr(self, name, col)  # (found as an attribute from now on)
        return col


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


class Block:
    """Rows of one integer table, appended one at a time (tuples of Python ints) or as
    arrays, in order; `array()` gives them all. `reserve` gives it room for a number of rows
    as one array, into which rows go as they come while they fit: `take` then gives that
    array's filled rows, with no copy (a copy of the gather's writes was a tenth of its
    time: its pages, fresh from the system, are faulted in once, not twice)."""

    def __init__(self, width: int) -> None:
        self.width, self.n = width, 0
        self.blocks: list[np.ndarray] = []
        self.tail: list[tuple[int, ...]] = []
        self.room: np.ndarray | None = None
        """The reserved rows (untouched pages cost no memory), filled up to `n`, while
        `blocks` is empty."""

    def __len__(self) -> int:
        return self.n

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows in all (those made so far included), while nothing is made:
        the rows past it go to blocks of their own."""
        if not self.n and self.room is None:
            self.room = np.empty((rows, self.width), dtype=np.int64)

    def append(self, row: tuple[int, ...]) -> None:
        self.tail.append(row)
        self.n += 1

    def extend(self, rows: np.ndarray) -> None:
        self._seal()
        self._put(rows)
        self.n += len(rows)

    def claim(self, rows: int) -> np.ndarray:
        """`rows` new rows after the others, unfilled, for the caller to fill before any
        other row is added: in the reserved rows where they fit (no copy of them is made),
        else an array of their own."""
        self._seal()
        room, at = self.room, self.n
        if room is not None and at + rows <= len(room):
            self.n += rows
            return room[at:at + rows]
        part = np.empty((rows, self.width), dtype=np.int64)
        self._put(part)
        self.n += rows
        return part

    def _put(self, rows: np.ndarray) -> None:
        """`rows` after the others (counted in `n` by the caller, before or after)."""
        room, at = self.room, self.n
        if room is not None:
            if at + len(rows) <= len(room):
                room[at:at + len(rows)] = rows
                return
            self.blocks.append(room[:at])  # (full: a block like the others from here on)
            self.room = None
        self.blocks.append(rows)

    def array(self) -> np.ndarray:
        """All rows as one array, which the block keeps as its only block (its parts are
        dropped: the rows are never held twice; a caller that changes the array in place
        changes the block's rows)."""
        self._seal()
        if self.room is not None:
            self.blocks, self.room = [self.room[:self.n]], None
        if len(self.blocks) != 1 or self.blocks[0].dtype != np.int64 or \
                self.blocks[0].base is not None:  # (one int64 array of its own: kept as is)
            self.blocks = [np.concatenate([np.zeros((0, self.width), dtype=np.int64),
                                           *self.blocks])]
        return self.blocks[0]

    def take(self, extra: int = 0) -> np.ndarray:
        """All rows as one int64 array, with `extra` rows more at its end (not filled: the
        caller's), and the block emptied: each part is dropped once copied, so the rows
        are never held twice; the reserved rows, where all fit, are not copied."""
        self._seal()
        room, n = self.room, self.n
        self.room = None
        if room is not None and n + extra <= len(room):
            self.n = 0
            return room[:n + extra]
        out = np.empty((n + extra, self.width), dtype=np.int64)
        at, parts = 0, self.blocks[::-1] if room is None else [room[:n]]  # (room: no blocks)
        del room
        self.blocks, self.n = [], 0
        while parts:
            part = parts.pop()
            out[at:at + len(part)] = part
            at += len(part)
            del part
        return out

    def _seal(self) -> None:
        if self.tail:
            rows = np.array(self.tail, dtype=np.int64).reshape(-1, self.width)
            self.n -= len(rows)  # (`_put` counts from the rows before them)
            self.tail = []
            self._put(rows)
            self.n += len(rows)


class Out:
    """Rows of writes and copies, turned into columns at the end."""

    W = ("src_rank", "src_region", "src_offset", "dst_rank", "dst_region", "dst_offset",
         "nbytes", "stage")
    C = ("rank", *(n for n, _ in COPY_COLUMNS))

    def __init__(self) -> None:
        self.writes = Block(8)
        self.strided = Block(11)
        """Runs of several writes: (*src, *dst, rows, row_bytes, src_stride, dst_stride,
        stage), expanded into rows at the end (`lowered`), after `writes`."""
        self.copies = Block(len(Out.C))
        self.explain = Block(6)
        self.pool1 = Block(4)
        """(copy, write, rank, element size): a PACK into pool 1 and the write of it, whose
        offsets count from the pool's start (`Staging`)."""

    def last(self) -> tuple[int, int]:
        """Row numbers of the last copy and the last write (of one row) so far."""
        return len(self.copies) - 1, len(self.writes) - 1

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

    def run_rows(self, runs: np.ndarray) -> np.ndarray:
        """`runs` as columns (`strided`'s): each one write or several, as `runs` makes;
        returns which are one write."""
        one = (runs[:, 6] == 1) | ((runs[:, 8] == runs[:, 7]) & (runs[:, 9] == runs[:, 7]))
        w = runs[one]
        self.writes.extend(np.concatenate([w[:, :6], w[:, 6:7] * w[:, 7:8], w[:, 10:]],
                                          axis=1))
        self.strided.extend(runs[~one])
        return one


def explain_rows(out: Out) -> np.ndarray:
    """(tensor, owner, staging region, target rank, target region, bytes) per fan-out,
    taken out of `out` (its reserved rows, where they hold all: not copied)."""
    return out.explain.take()


def lowered(out: Out, alloc: Staging, stages: int, base: int = 0,
            n_regions: np.ndarray | None = None) -> Lowered:
    """The gather's columns; with `alloc.halves`, each round's staging offsets moved into
    its half of each pool (`_halves`; `base`: the first gather stage, `n_regions`: each
    rank's staging region), and the gathers of round 1 on (stage `base + 2` on) waiting
    for their owner's SLOT_ACK (`Lowered.sources_slotted`)."""
    n = len(out.writes)
    runs = out.strided.take() if len(out.strided) else None
    w = out.writes.take(0 if runs is None else int(runs[:, 6].sum()))
    if runs is not None:
        _expand(runs, w[n:])
        del runs
    c = out.copies.take()
    if alloc.halves and n_regions is not None:
        staging = _halves(out, alloc, w, c, base, np.asarray(n_regions, dtype=np.int64))
    else:
        staging = alloc.staging
        if len(out.pool1):  # pool 1 starts where pool 0 ends on its rank
            ci, wi, rank, es = out.pool1.array().T
            c[ci, Out.C.index("dst_offset")] += alloc.pool1[rank] // es
            w[wi, Out.W.index("src_offset")] += alloc.pool1[rank]
    copies = {name: c[:, i] for i, name in enumerate(Out.C)}
    return Lowered(*(w[:, i] for i in range(8)), copies=copies, staging=staging,
                   stages=stages,
                   sources_slotted=base + 2 if alloc.halves and n_regions is not None else -1)


def _halves(out: Out, alloc: Staging, w: np.ndarray, c: np.ndarray, base: int,
            stg: np.ndarray) -> np.ndarray:
    """Place each round's staging in its half of each pool, in place in `w` and `c`, and
    return each rank's staging bytes. A rank's staging is [pool 0 even | pool 0 odd |
    pool 1 even | pool 1 odd], each part as large as the most its rounds use there
    (aligned; the last part ends at its last byte). Round k is stages `base + 2k` (gather)
    and `base + 2k + 1` (convert, fan out); until here every offset counts from its
    pool's start. The tables are read `SLICE` rows at a time (each column of a slice read
    while the slice is in the cache, not each column of the whole table in turn)."""
    world = len(stg)
    w_p1, c_p1 = np.zeros(len(w), bool), np.zeros(len(c), bool)
    if len(out.pool1):
        ci, wi, _, _ = out.pool1.array().T
        c_p1[ci], w_p1[wi] = True, True
    # the end (bytes from its pool's start) of every write and copy into staging, by
    # (rank, part): part = 2 * pool + odd
    end = np.zeros((world, 4), dtype=np.int64)
    for lo in range(0, len(w), SLICE):
        _write_ends(w[lo:lo + SLICE], w_p1[lo:lo + SLICE], base, stg, end)
    for lo in range(0, len(c), C_SLICE):  # (`_copy_ends` takes a slice's rows whole)
        _copy_parts(c[lo:lo + C_SLICE], c_p1[lo:lo + C_SLICE], base, stg, end)
    size = -(-end // ALIGN) * ALIGN
    start = np.cumsum(size, axis=1) - size  # where each part starts
    last = np.where(end > 0, start + end, 0).max(axis=1)
    # move every staging offset to its part
    for lo in range(0, len(w), SLICE):
        _write_ends(w[lo:lo + SLICE], w_p1[lo:lo + SLICE], base, stg, end, start)
    for lo in range(0, len(c), SLICE):
        _copy_parts(c[lo:lo + SLICE], c_p1[lo:lo + SLICE], base, stg, end, start)
    return last


SLICE = 1 << 15
"""Rows of the gather's tables `_halves` reads at a time."""
C_SLICE = 1 << 13
"""Copies `_halves` reads at a time to find their ends (their rows taken whole: 1.2 MB)."""


def _write_ends(w: np.ndarray, p1: np.ndarray, base: int, stg: np.ndarray, end: np.ndarray,
                start: np.ndarray | None = None) -> None:
    """`_halves` of writes `w` (`p1`: those from pool 1): their staging ends into `end`,
    or with `start`, their staging offsets moved to their parts."""
    W = Out.W.index
    odd = ((w[:, W("stage")] - base) >> 1) & 1
    s_rank, d_rank = w[:, W("src_rank")], w[:, W("dst_rank")]
    src = w[:, W("src_region")] == stg[s_rank]
    dst = w[:, W("dst_region")] == stg[d_rank]
    if start is None:
        flat = end.reshape(-1)
        m = np.flatnonzero(dst)
        _max_at(flat, d_rank[m] * 4 + odd[m], w[m, W("dst_offset")] + w[m, W("nbytes")])
        m = np.flatnonzero(src & p1)
        _max_at(flat, s_rank[m] * 4 + 2 + odd[m], w[m, W("src_offset")] + w[m, W("nbytes")])
        return
    flat = start.reshape(-1)
    m = np.flatnonzero(src)
    w[m, W("src_offset")] += flat[s_rank[m] * 4 + 2 * p1[m] + odd[m]]
    m = np.flatnonzero(dst)
    w[m, W("dst_offset")] += flat[d_rank[m] * 4 + odd[m]]


def _copy_parts(c: np.ndarray, p1: np.ndarray, base: int, stg: np.ndarray, end: np.ndarray,
                start: np.ndarray | None = None) -> None:
    """`_write_ends` of copies `c`."""
    C = Out.C.index
    odd = ((c[:, C("stage")] - base) >> 1) & 1
    rank = c[:, C("rank")]
    m = np.flatnonzero(c[:, C("dst_region")] == stg[rank])
    if start is None:
        _max_at(end.reshape(-1), rank[m] * 4 + 2 * p1[m] + odd[m], _copy_ends(c, m))
        return
    flat = start.reshape(-1)
    at = flat[rank[m] * 4 + 2 * p1[m] + odd[m]]
    s = np.flatnonzero(c[:, C("src_region")] == stg[rank])  # reads of staging: pool 0
    c[s, C("src_offset")] += flat[rank[s] * 4 + odd[s]] // ITEM[c[s, C("src_dtype")]]
    c[m, C("dst_offset")] += at // ITEM[c[m, C("dst_dtype")]]
    q = c[m, C("kind")] == QUANT
    c[m[q], C("aux_offset")] += at[q] // SCALE_BYTES


def _max_at(out: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:
    """`np.maximum.at(out, at, values)`, by runs of equal `at` (consecutive rows mostly
    share their key: a box's writes, a round's copies): one maximum a run, then
    `maximum.at` of the runs' (a tenth of the rows or less; `maximum.at` row by row was
    most of `_halves`' first pass)."""
    if len(at):
        first = np.flatnonzero(np.concatenate([[True], at[1:] != at[:-1]]))
        np.maximum.at(out, at[first], np.maximum.reduceat(values, first))


def _copy_ends(c: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The end (byte after the last) of what copies `rows` write, their scales included
    (`schemas.protocol.copy_footprint`'s dst rule)."""
    C = Out.C.index
    c = c[rows]  # (the rows taken whole, once: their columns read from the slice)
    quant = c[:, C("kind")] == QUANT
    item = ITEM[c[:, C("dst_dtype")]]
    sizes = [c[:, C(f"size{d}")] for d in range(3)]
    strides = [c[:, C(f"dst_stride{d}")] for d in range(3)]
    sizes[2] = np.where(quant, 1, sizes[2])
    strides[1] = np.where(quant, 1, strides[1])
    last = c[:, C("dst_offset")].copy()
    for n, st in zip(sizes, strides):
        last += (n - 1) * st
    end = (last + 1) * item
    n0, n1 = sizes[0], sizes[1]
    rb, cb = -(-n0 // FP8_BLOCK), -(-n1 // FP8_BLOCK)
    a = c[:, C("aux_offset")]
    s_end = (a + (rb - 1) * scale_stride(c[:, C("dst_stride0")]) + cb) * SCALE_BYTES
    return np.where(quant, np.maximum(end, s_end), end)


def _expand(runs: np.ndarray, out: np.ndarray) -> None:
    """Runs (`Out.strided`) as their writes (`Out.W` columns), run by run, row by row, into
    `out` (as many rows)."""
    rows = runs[:, 6]
    run = np.repeat(np.arange(len(runs)), rows)
    k = np.arange(len(run), dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)
    for j, c in enumerate((0, 1, 2, 3, 4, 5, 7, 10)):
        out[:, j] = runs[run, c]
    out[:, 2] += k * runs[run, 8]
    out[:, 5] += k * runs[run, 9]
