"""Writing a plan file (`schemas/plan.py` has the format and the reading half).

`encode_plan` gives the file's bytes; `write_plan` writes the same bytes without holding
the plain ones: the blobs are packed as parts that leave table columns in place, each
compressed (the compact form, the default) and digested, then the head (which indexes
them) is written, then the blobs.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np

from .plan import FORMAT_VERSION, MAGIC, Plan, Region, region_row
from .plan_codec import checksum, deflate, pack
from .table import NARROW, RangedTable, Table, narrow_code, stored_plainly


def encode_plan(plan: Plan, key: bytes | None = None, compact: bool = True) -> bytes:
    """The bytes of a plan file; deterministic for equal plans. With `key`, the header
    carries an HMAC-SHA256 `signature` over everything (`schemas/integrity.py`). `compact`:
    every blob stored compact (`schemas/plan_codec.py`), else plain."""
    index, blobs = _stored_blobs(plan, compact)
    return b"".join([_head(plan, key, index)] + [p for parts in blobs for p in parts])


def _stored_blobs(plan: Plan, compact: bool
                  ) -> tuple[dict[str, list[Any]], list[list[bytes | memoryview]]]:
    """The blob index (offset, length, digest of every blob as stored) and each blob's stored
    bytes as parts. Every blob is packed as parts that leave table columns in the plan's
    arrays (`_parts`), then compressed (`compact`) and digested on a second thread while the
    next is packed (zlib and blake2b release the GIL): memory holds the compact blobs, not
    the plan's bytes again."""
    from concurrent.futures import ThreadPoolExecutor

    buffers = _Buffers()  # the one compressing thread's, blob after blob
    store = (lambda parts: _compact(parts, buffers)) if compact else _plain
    index: dict[str, list[Any]] = {}
    blobs: list[list[bytes | memoryview]] = []
    pending: deque[tuple[str, Any]] = deque()

    def take() -> None:
        name, future = pending.popleft()
        parts, n, digest = future.result()
        index[name] = [_end(index), n, digest]
        blobs.append(parts)

    with ThreadPoolExecutor(1) as pool:
        for name, parts in _blob_parts(plan):
            pending.append((name, pool.submit(store, parts)))
            if len(pending) > 2:  # at most three blobs packed ahead of the one written
                take()
        while pending:
            take()
    return index, blobs


def _end(index: dict[str, list[Any]]) -> int:
    """Where the next blob goes: after the last one indexed."""
    if not index:
        return 0
    last = next(reversed(index.values()))
    return last[0] + last[1]


def _compact(parts: list[bytes | memoryview], buffers: _Buffers | None = None
             ) -> tuple[list[bytes | memoryview], int, bytes]:
    data = deflate(_released(parts, buffers))
    return [data], len(data), checksum(data)


RELEASE_SLICE = 8 << 20
"""Bytes of a file-mapped part compressed before its pages are dropped (`_released`)."""


def _released(parts: list[Any], buffers: _Buffers | None = None
              ) -> Iterator[bytes | memoryview]:
    """`parts` in order (`_expanded`), each part mapped from a file (a spilled table's
    column, a spilled blob: `mmap` underneath) in `RELEASE_SLICE` slices, each slice's pages
    dropped from this process once the consumer asks for the next (`MADV_DONTNEED`: a shared
    file mapping reads them again from the file if touched again). The bytes are the same;
    reading a spilled blob no longer keeps all of it resident, so a plan's spilled hundreds
    of MB are never in the process at once. Each part is done with before the next is
    asked for: the narrowed slices are made in `buffers` (`_expanded`)."""
    for part in _expanded(parts, _Buffers() if buffers is None else buffers):
        m = _mapping(part)
        if m is None or len(part) == 0:
            yield part
            continue
        mv = memoryview(part).cast("B")
        for lo in range(0, len(mv), RELEASE_SLICE):
            piece = mv[lo:lo + RELEASE_SLICE]
            yield piece
            _drop(m, piece)


def _mapping(part: bytes | memoryview) -> mmap.mmap | None:
    """The `mmap` a part's bytes lie in (through memoryviews and numpy arrays), or None."""
    x: Any = part
    for _ in range(8):
        if isinstance(x, mmap.mmap):
            return x
        x = x.obj if isinstance(x, memoryview) else getattr(x, "base", None)
        if x is None:
            return None
    return None


def _drop(m: mmap.mmap, piece: memoryview) -> None:
    """Drop the pages under `piece` (rounded out to whole pages, within `m`) from this
    process's mapping of `m`."""
    base = np.frombuffer(m, dtype=np.uint8).ctypes.data
    lo = np.frombuffer(piece, dtype=np.uint8).ctypes.data - base
    start = lo - lo % mmap.PAGESIZE
    m.madvise(mmap.MADV_DONTNEED, start, min(lo + len(piece), len(m)) - start)


def _plain(parts: list[Any]) -> tuple[list[bytes | memoryview], int, bytes]:
    parts = list(_expanded(parts))
    return parts, sum(len(p) for p in parts), _digest_parts(parts)


class _Column:
    """A table column that `_parts` leaves to be put in its stored form (`stored_column`)
    when its bytes are asked for (`_expanded`): on the thread that compresses them, one
    column at a time. `span`: its least and greatest values where known already (a
    `RangedTable`'s)."""

    __slots__ = ("column", "span")

    def __init__(self, column: np.ndarray, span: tuple[int, int] | None = None) -> None:
        self.column = column
        self.span = span


class _Buffers:
    """One buffer per dtype that `_expanded` narrows a column's slices into, reused slice
    after slice (for a consumer that is done with each part before it asks for the next:
    `_released`'s deflate): a slice of a few MB narrowed afresh each time would fault its
    pages in afresh, each zeroed by the kernel."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: dict[np.dtype, np.ndarray] = {}

    def narrowed(self, piece: np.ndarray, dt: np.dtype) -> np.ndarray:
        """`piece.astype(dt)`, in the buffer of `dt`."""
        buf = self.held.get(dt)
        if buf is None or len(buf) < len(piece):
            buf = self.held[dt] = np.empty(max(len(piece), RELEASE_SLICE // 8), dtype=dt)
        out = buf[:len(piece)]
        np.copyto(out, piece, casting="unsafe")  # (as `astype`: every value fits)
        return out


def _expanded(parts: list[Any], buffers: _Buffers | None = None
              ) -> Iterator[bytes | memoryview]:
    """`parts` with each `_Column` replaced by the parts of its stored form
    (`table.stored_column`'s bytes), made as they are asked for: a column's span and its
    narrowed values a `RELEASE_SLICE` of it at a time, the pages of a column mapped from a
    file (the spilled explain table) dropped once read, so no column is held whole again.
    `buffers`: where the narrowed slices are made, for a consumer done with each part
    before it asks for the next (else each is a new array)."""
    for part in parts:
        if type(part) is not _Column:
            yield part
            continue
        col = part.column
        if stored_plainly(col):
            yield from _raw(col)
            continue
        step = max(1, RELEASE_SLICE // col.dtype.itemsize)
        m = _mapping(col)  # (once a column: its pieces lie in the same mapping)
        if part.span is not None:  # known: the column is read once, below
            lo, hi = part.span
        elif len(col) <= step:  # one piece (most columns: a rank's rows)
            lo, hi = int(col.min()), int(col.max())
            _dropped(m, col)
        else:
            lo, hi = None, None
            for at in range(0, len(col), step):
                piece = col[at:at + step]
                a, b = int(piece.min()), int(piece.max())
                lo, hi = a if lo is None else min(lo, a), b if hi is None else max(hi, b)
                _dropped(m, piece)
        code = narrow_code(lo, hi, col.dtype.itemsize)
        if code is None:
            yield from _raw(col)
        else:
            narrow = np.dtype(NARROW[code])
            yield _HEADS[code] + _bin_header(len(col) * narrow.itemsize)
            for at in range(0, len(col), step):
                piece = col[at:at + step]
                yield memoryview(piece.astype(narrow) if buffers is None else
                                 buffers.narrowed(piece, narrow)).cast("B")
                _dropped(m, piece)


def _raw(col: np.ndarray) -> tuple[bytes, memoryview]:
    """Column `col` stored raw: its bin header, then its bytes in place (`pack` of the
    memoryview would copy the whole column into one bytes object; a column mapped from a
    file stays mapped, so `_released` drops its pages as they are compressed)."""
    view = memoryview(col).cast("B")
    return _bin_header(view.nbytes), view


def _dropped(m: mmap.mmap | None, piece: np.ndarray) -> None:
    """Drop the pages under `piece` from this process where it is mapped from a file (`m`,
    its `_mapping`)."""
    if m is not None and piece.nbytes:
        _drop(m, memoryview(piece).cast("B"))


def _head(plan: Plan, key: bytes | None, index: dict[str, list[Any]]) -> bytes:
    """Magic, version, the header (with the blob `index`, signed with `key`), its digest."""
    raw = {**plan.header.encode(), "format_version": FORMAT_VERSION, "blobs": index}
    if key is not None:
        from .integrity import signature

        raw["signature"] = signature(key, pack(raw))
    header = pack(raw)
    return MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(header)) + header + checksum(header)


def _blob_objects(plan: Plan) -> Iterator[tuple[str, Any]]:
    """Every blob of the plan file as the object msgpack packs, in file order (each made
    when asked for), its tables' columns in their stored forms."""
    for name, obj in _blobs(plan, None):
        yield name, {k: v.table.stored() if type(v) is _Stored else v for k, v in obj.items()} \
            if isinstance(obj, dict) else obj


def _blob_parts(plan: Plan) -> Iterator[tuple[str, list[bytes | memoryview]]]:
    """`_blob_objects` packed (`_parts`), each made when asked for; the ranks' regions lists
    packed a region at a time, each region once for every part that lists it."""
    rows: dict[int, bytes] = {}  # id(region or regions) -> its msgpack
    for name, obj in _blobs(plan, rows):
        yield name, _parts(obj)


RANK_TABLES = ("writes", "batches", "copies", "signals", "waits")
"""A rank part's op tables (`RankPlan.encode`'s keys), stored in their columns' stored forms."""


def _blobs(plan: Plan, rows: dict[int, bytes] | None) -> Iterator[tuple[str, Any]]:
    """`_blob_objects`, each table a `_Stored` (`_parts` packs its columns' stored forms);
    with `rows`, each rank's regions list as its msgpack bytes (`_packed_regions`), which
    only `_parts` takes."""
    ids = plan.header.identities
    for r in plan.ranks:
        enc = r.encode(None if rows is None else _packed_regions(r.regions, rows),
                       lists=rows is None)
        for k in RANK_TABLES:
            enc[k] = _Stored(getattr(r, k))
        # each part carries its rank's identity (schemas/identity.py)
        if "identity" not in enc and 0 <= r.rank < len(ids):
            enc["identity"] = dict(ids[r.rank])
        yield f"rank/{r.rank}", enc
    yield "explain", {"tensors": list(plan.tensors), "table": _Stored(plan.explain)}
    yield "dag", {"nodes": _Stored(plan.dag_nodes), "edges": _Stored(plan.dag_edges),
                  "coverage": _Stored(plan.coverage)}
    yield from plan.extra_blobs


class _Packed(bytes):
    """A value's msgpack bytes, packed already: `_parts` takes them as they are."""


class _Stored:
    """A table of a blob: `_parts` packs it as `Table.stored` would be, each column left as
    a `_Column` for the compressing thread."""

    __slots__ = ("table",)

    def __init__(self, table: Table) -> None:
        self.table = table


def _packed_regions(regions: tuple[Region, ...], rows: dict[int, bytes]) -> bytes:
    """msgpack of a part's regions list (`region_row` each), each region packed once for
    every part that lists it, and each tuple of regions once (`rows`, by identity: ranks
    share them, and the plan holds them while it is written)."""
    whole = rows.get(id(regions))
    if whole is None:
        out = [_PACKER.pack_array_header(len(regions))]
        for r in regions:
            b = rows.get(id(r))
            if b is None:
                b = rows[id(r)] = pack(region_row(r))
            out.append(b)
        whole = rows[id(regions)] = _Packed(b"".join(out))
    return whole


def _parts(obj: Any) -> list[bytes | memoryview]:
    """`pack(obj)` as parts whose concatenation is those bytes, a table's column bytes left
    in place (not copied into one buffer, whose growth would hold them two or three times):
    a map is its header and its keys' and values' parts, a list of memoryviews (a table) its
    header and each column's bin header and bytes, a `_Stored` table its header and a
    `_Column` a column (`_expanded` packs it); bytes packed already (`_Packed`) are taken as they
    are; anything else is packed whole."""
    if type(obj) is _Packed:
        return [obj]
    if type(obj) is _Stored:
        cols = obj.table.columns
        spans = obj.table.ranges if isinstance(obj.table, RangedTable) else ()
        return [_PACKER.pack_array_header(len(cols)),
                *(_Column(c, spans[i] if i < len(spans) else None) for i, c in enumerate(cols))]
    if isinstance(obj, dict):
        out: list[bytes | memoryview] = [_PACKER.pack_map_header(len(obj))]
        for k, v in obj.items():
            out.append(pack(k))
            out += _parts(v)
        return out
    if isinstance(obj, list) and obj and all(isinstance(v, memoryview) for v in obj):
        out = [_PACKER.pack_array_header(len(obj))]
        for v in obj:
            out += [_bin_header(v.nbytes), v]
        return out
    return [pack(obj)]


_PACKER = msgpack.Packer(use_bin_type=True)
_HEADS = {code: _PACKER.pack_array_header(2) + pack(code) for code in NARROW}
"""The start of each narrow column's stored form (`[code, bin]`), up to its bin's header."""


def _bin_header(n: int) -> bytes:
    """msgpack's header of a bin of `n` bytes (bin 8, 16 or 32)."""
    if n < 1 << 8:
        return struct.pack(">BB", 0xC4, n)
    if n < 1 << 16:
        return struct.pack(">BH", 0xC5, n)
    return struct.pack(">BI", 0xC6, n)


def _digest_parts(parts: list[Any]) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    for part in _expanded(parts):
        h.update(part)
    return h.digest()


def packed_digest(obj: Any) -> bytes:
    """blake2b-256 of `pack(obj)`, digested as the parts `write_plan` packs (a list of
    memoryviews, a table's columns, is digested in place, never copied into one buffer)."""
    return _digest_parts(_parts(obj))


def write_plan(path: str, plan: Plan, key: bytes | None = None, compact: bool = True) -> int:
    """Write `plan` to `path` atomically (temp file + rename); returns the size in bytes.

    The header indexes the blobs (offsets, lengths, digests of the bytes stored), so the
    blobs are made first (`_stored_blobs`: compact ones are held, plain ones as parts left in
    the plan's arrays), then the head and the blobs written in order; the file is
    `encode_plan`'s bytes."""
    import os

    index, blobs = _stored_blobs(plan, compact)
    head = _head(plan, key, index)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(head)
        for parts in blobs:
            for part in parts:
                f.write(part)
    os.replace(tmp, path)
    return len(head) + sum(n for _, n, _ in index.values())
