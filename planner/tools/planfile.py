"""A plan read one rank at a time: what `verify`, `inspect` and `simulate` hold of a large
plan (a large model's plan is over a GB; one rank's part is a few MB).

`PlanFile(path)` checks what `load_plan` checks of the file as a whole (header, checksum,
one blob per rank) at open; `rank(r)` decodes and checksums one rank's blob. `PlanRanks`
gives a `Plan` already in memory the same face, so each tool has one implementation.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO

import msgpack
import numpy as np

from schemas.errors import PlanFormatError
from schemas.header import PlanHeader
from schemas.plan import (
    COVERAGE_COLUMNS,
    DAG_EDGE_COLUMNS,
    DAG_NODE_COLUMNS,
    EXPLAIN_COLUMNS,
    Plan,
    RankPlan,
    Table,
    check_blob,
    decode_explain,
    open_plan,
    read_blob,
    read_header,
)
from schemas.plan_codec import CODECS, FRAME_HEAD, MAX_DECODED, MAX_RATIO, read_exact
from schemas.table import narrow_dtype


class _Unsure(Exception):
    """The streamed check cannot vouch for the blob: the whole decode decides."""


def _no_ext(code: int, data: bytes) -> Any:
    raise _Unsure  # an extension type: the whole decode refuses it


_PIECE = 256 << 10
"""Stored bytes of the explain blob given to zlib at a time."""
_STEP = 1 << 20
"""Decoded bytes of the explain blob made at a time."""


def explain_streamed(f: BinaryIO, header: PlanHeader, start: int, path: str) -> bool:
    """Whether the explain blob passes what `decode_explain(read_blob(...))` checks, decided
    as it inflates, holding none of the table's columns (the blob decodes to hundreds of MB
    on a large plan; a column is a msgpack bin, or a narrow one's code and bin: lengths and
    codes are all there is to check): its stored bytes and
    digest, the compact frame's bounds, the deflate stream exactly its declared size, plain
    msgpack (no extension) of one map whose keys are strings, `tensors` a list of strings
    and `table` the explain table's columns, whole items of one length, nothing after it.
    False where the stream is not so (malformed or unusual): the caller then decodes the
    blob whole, which says what is wrong."""
    entry = header.blobs.get("explain")
    if entry is None:
        return False
    f.seek(start + entry.offset)
    what = f"{path} blob 'explain'"
    data = read_exact(f, entry.length, what, entry.digest)
    wbits = CODECS.get(data[:2])
    if wbits is None or len(data) < FRAME_HEAD:
        return False
    (n,) = struct.unpack_from("<Q", data, 2)
    if n > MAX_RATIO * (len(data) - FRAME_HEAD) + 64 or n > MAX_DECODED:
        return False
    z = zlib.decompressobj(wbits)
    u = msgpack.Unpacker(raw=False, strict_map_key=True, ext_hook=_no_ext, max_ext_len=0,
                         max_buffer_size=max(n, 1))
    stream = memoryview(data)[FRAME_HEAD:]
    state = {"tail": b"", "at": 0, "made": 0, "skipped": 0}

    def inflate(most: int) -> bytes:
        """Up to `most` more decoded bytes; none only at the end of the input. The stream is
        given to zlib `_PIECE` bytes at a time: what it leaves unread is copied each call."""
        while True:
            if not state["tail"] and state["at"] < len(stream):
                state["tail"] = stream[state["at"]:state["at"] + _PIECE]
                state["at"] += _PIECE
            out = z.decompress(state["tail"], most)
            state["tail"] = z.unconsumed_tail
            state["made"] += len(out)
            if state["made"] > n:
                raise _Unsure
            if out or not state["tail"] and state["at"] >= len(stream):
                return out

    def more() -> bool:
        out = inflate(_STEP)
        u.feed(out)
        return bool(out)

    def take(read: Callable[[], Any]) -> Any:
        while True:
            try:
                return read()
            except msgpack.OutOfData:
                if not more():
                    raise _Unsure from None

    def raw(k: int) -> bytes:
        """The next `k` bytes of the stream, as they are."""
        got = u.read_bytes(k)
        while len(got) < k:
            if not more():
                raise _Unsure
            got += u.read_bytes(k - len(got))
        return got

    def column(head: int) -> int:
        """The length of the bin item next in the stream, whose first byte `head` was read
        (anything else: `_Unsure`), its bytes passed over, never fed to `u` nor kept: a
        column is tens of MB."""
        width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(head)
        if width is None:
            raise _Unsure  # not a bin: the whole decode gives no bytes for it
        size = int.from_bytes(raw(width), "big")
        left = size - len(u.read_bytes(size))  # what `u` already holds of it
        state["skipped"] += left
        while left:
            out = inflate(min(left, _STEP))
            if not out:
                raise _Unsure
            left -= len(out)
        return size

    def rows_of(dt: str) -> int:
        """The rows of the column next in the stream in either stored form (`schemas.table`,
        checked as `Table.from_msgpack` does)."""
        head = raw(1)[0]
        if head != 0x92:  # a fixarray of two: a narrow column
            length, size = column(head), np.dtype(dt).itemsize
        else:
            narrow = narrow_dtype(take(u.unpack), dt)
            if narrow is None:
                raise _Unsure
            length, size = column(raw(1)[0]), narrow.itemsize
        if length % size:
            raise _Unsure
        return length // size

    try:
        seen: set[str] = set()
        for _ in range(take(u.read_map_header)):
            key = take(u.unpack)
            if not isinstance(key, str) or key in seen:
                raise _Unsure
            seen.add(key)
            if key == "table":
                if take(u.read_array_header) != len(EXPLAIN_COLUMNS):
                    raise _Unsure
                rows = {rows_of(dt) for _, dt in EXPLAIN_COLUMNS}
                if len(rows) != 1:
                    raise _Unsure
            else:
                value = take(u.unpack)
                if key == "tensors" and (not isinstance(value, list)
                                         or set(map(type, value)) - {str}):
                    raise _Unsure
                del value
        while more():
            pass
        if not {"tensors", "table"} <= seen or state["made"] != n or not z.eof \
                or z.unconsumed_tail or z.unused_data or u.tell() + state["skipped"] != n:
            raise _Unsure
    except (_Unsure, zlib.error, ValueError, TypeError, msgpack.UnpackException):
        return False  # malformed or unusual: the whole decode decides, and says what is wrong
    return True


class PlanRanks:
    """A plan in memory, rank by rank."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.header: PlanHeader = plan.header
        self.world = len(plan.ranks)

    def rank(self, r: int) -> RankPlan:
        return self.plan.ranks[r]

    def dag(self) -> tuple[Table, Table, Table]:
        """The stage DAG's nodes and edges, and the coverage table."""
        return self.plan.dag_nodes, self.plan.dag_edges, self.plan.coverage

    def check_rest(self, progress: Callable[[str], None] | None = None) -> None:
        """Check the blobs other than the ranks and the DAG (in memory: nothing to check)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> PlanRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PlanFile(PlanRanks):
    """A plan file, rank by rank (`key`: the plan must be signed with it)."""

    def __init__(self, path: str, key: bytes | None = None) -> None:
        self.path = path
        self.f: BinaryIO = open_plan(path)  # a regular file only
        try:
            self.header, self.start = read_header(self.f, path, key)
            world = self.header.world
            names = [n for n in self.header.blobs if n.startswith("rank/")]
            if len(names) != world or set(names) != {f"rank/{r}" for r in range(world)}:
                raise PlanFormatError(f"{path}: the header says world={world} but the file "
                                      f"holds {len(names)} rank blobs; the file is corrupt")
        except BaseException:
            self.f.close()
            raise
        self.world = world

    def blob(self, name: str) -> Any:
        return read_blob(self.f, self.header, self.start, name, self.path)

    def rank(self, r: int) -> RankPlan:
        rp = RankPlan.decode(self.blob(f"rank/{r}"))
        if rp.rank != r:
            raise PlanFormatError(f"{self.path}: blob rank/{r} holds the plan of rank "
                                  f"{rp.rank}; the file is corrupt")
        return rp

    def dag(self) -> tuple[Table, Table, Table]:
        dag = self.blob("dag")
        if not isinstance(dag, dict):
            raise PlanFormatError(f"{self.path}: dag blob is malformed")
        try:
            return (Table.from_msgpack(DAG_NODE_COLUMNS, dag["nodes"], "dag.nodes"),
                    Table.from_msgpack(DAG_EDGE_COLUMNS, dag["edges"], "dag.edges"),
                    Table.from_msgpack(COVERAGE_COLUMNS, dag["coverage"], "coverage"))
        except (KeyError, TypeError) as e:
            raise PlanFormatError(f"{self.path}: dag blob is malformed ({e})") from None

    def check_rest(self, progress: Callable[[str], None] | None = None) -> None:
        """The explain blob and any further blobs, checksummed and decoded, as `load_plan`
        does (one at a time, nothing kept). The explain blob is a third of a large plan's
        bytes (seconds at DeepSeek-V3 scale): a step of its own for `progress`."""
        if progress is not None:
            progress("checking the explain blob")
        if not explain_streamed(self.f, self.header, self.start, self.path):
            decode_explain(self.blob("explain"), self.path)
        for name in self.header.blobs:  # (read_blob's checks, nothing kept)
            if not name.startswith("rank/") and name not in ("explain", "dag"):
                check_blob(self.f, self.header, self.start, name, self.path)

    def check_all(self, progress: Callable[[str], None] | None = None) -> None:
        """What `load_plan` checks of the file, one blob at a time, nothing kept: every
        rank's part decoded, the DAG, the explain blob and the rest (`check_rest`)."""
        tick = ticker(progress, "ranks", self.world)
        for r in range(self.world):
            self.rank(r)
            tick(r)
        self.dag()
        self.check_rest(progress)

    def close(self) -> None:
        self.f.close()


def ticker(progress: Callable[[str], None] | None, what: str, total: int
           ) -> Callable[[int], None]:
    """`tick(i)` reports `what i/total` to `progress` at every tenth of `total`."""
    step = max(1, total // 10)

    def tick(i: int) -> None:
        if progress is not None and (i % step == 0 or i == total - 1):
            progress(f"{what} {i + 1}/{total}")
    return tick
