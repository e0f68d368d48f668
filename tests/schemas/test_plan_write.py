"""`write_plan`'s file is `encode_plan`'s bytes (compact and plain), and `_parts` (tables'
column bytes left in place) joins to msgpack's own packing, and `packed_digest` is the
digest of those bytes."""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path

import numpy as np

from planner.compiler import compile_config
from planner.validate import load
from schemas.plan import region_row
from schemas.plan_codec import deflate, pack
from schemas.plan_write import (
    RANK_TABLES,
    RELEASE_SLICE,
    _blob_objects,
    _blob_parts,
    _expanded,
    _mapping,
    _parts,
    _released,
    _Stored,
    encode_plan,
    packed_digest,
    write_plan,
)

ROOT = Path(__file__).resolve().parents[2]


def test_parts_join_to_msgpack() -> None:
    for n in (0, 1, 255, 256, 65535, 65536, 70000):
        col = memoryview(np.arange(n, dtype=np.uint8))
        for obj in ({"t": [col, col], "n": 3, "rows": [[1, "x"]], "e": []}, [col], {}):
            assert b"".join(bytes(p) for p in _parts(obj)) == pack(obj)


def test_rank_parts_are_the_packed_rank_plans() -> None:
    """The parts written (each rank's regions list packed once per region, each table
    column put in its stored form as it is asked for) join to msgpack's packing of each
    blob's object: a rank's part is `RankPlan.encode` with the identity it carries and its
    tables in their stored forms."""
    plan = compile_config(*load(str(ROOT / "plans/demo.yaml")))
    ranks = {f"rank/{r.rank}": r for r in plan.ranks}
    objects = list(_blob_objects(plan))
    parts = list(_blob_parts(plan))
    assert [n for n, _ in parts] == [n for n, _ in objects]
    for (name, obj), (_, got) in zip(objects, parts):
        assert b"".join(bytes(p) for p in _expanded(got)) == pack(obj)
        if name in ranks:
            r = ranks[name]
            want = {**r.encode(), **{k: getattr(r, k).stored() for k in RANK_TABLES}}
            if r.identity is None and r.rank < len(plan.header.identities):
                want["identity"] = dict(plan.header.identities[r.rank])
            assert obj == want and want["regions"] == [region_row(x) for x in r.regions]
    assert sum(n in ranks for n, _ in parts) == len(plan.ranks) > 1


def test_packed_digest_is_the_packed_bytes_digest() -> None:
    """`packed_digest` digests exactly `pack(obj)`: a table's columns as memoryviews give
    the digest of the same object with the columns as bytes."""
    rng = np.random.default_rng(3)
    for n in (0, 1, 40, 70000):
        cols = [rng.integers(0, 1 << 40, n).tobytes() for _ in range(3)]
        obj = {"names": ["a"], "shapes": [[3, 4]], "buffer": b"\x00", "pieces": cols}
        want = hashlib.blake2b(pack(obj), digest_size=32).digest()
        assert packed_digest({**obj, "pieces": [memoryview(c) for c in cols]}) == want
        assert packed_digest(obj) == want
        other = {**obj, "pieces": [*cols[:2], cols[2][:-1] + b"\x01"]} if n else \
            {**obj, "names": ["b"]}
        assert packed_digest(other) != want


def test_written_file_is_the_encoded_plan(tmp_path) -> None:
    plan = compile_config(*load(str(ROOT / "plans/demo.yaml")))
    path = tmp_path / "p.rplan"
    size = write_plan(str(path), plan, b"k" * 32)
    data = path.read_bytes()
    assert size == len(data) and data == encode_plan(plan, b"k" * 32)
    assert [p.name for p in tmp_path.iterdir()] == ["p.rplan"]  # no temporary file left behind
    size = write_plan(str(path), plan, b"k" * 32, compact=False)
    assert path.read_bytes() == encode_plan(plan, b"k" * 32, compact=False)
    assert size == path.stat().st_size > len(data)


def _mapped_rss_kib(m: mmap.mmap) -> int:
    """This process's resident KiB of the mapping `m` (its `/proc/self/smaps` entry)."""
    addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= addr < hi
        elif found and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("mapping not found")


def test_mapped_parts_are_read_in_full_and_dropped_once_read(tmp_path) -> None:
    """A spilled (file-mapped) column compresses to the same stream as its bytes, and its
    pages leave the process as it is read: a spilled explain table is never resident whole."""
    data = np.random.default_rng(0).integers(0, 50, 3 * RELEASE_SLICE + 12345, np.uint8)
    with open(tmp_path / "spill", "w+b") as f:
        f.write(data.tobytes())
        f.flush()
        m = mmap.mmap(f.fileno(), len(data), access=mmap.ACCESS_READ)
    col = np.frombuffer(m, dtype=np.int32, offset=4100, count=(len(data) - 4200) // 4)
    parts = [b"head", memoryview(col).cast("B"), memoryview(m)[7:5000]]
    assert _mapping(parts[1]) is m and _mapping(parts[2]) is m and _mapping(parts[0]) is None
    whole = b"".join(bytes(p) for p in parts)  # (read without releasing: all resident)
    assert _mapped_rss_kib(m) * 1024 > 2 * RELEASE_SLICE
    m.madvise(mmap.MADV_DONTNEED)
    got, most = [], 0
    for piece in _released(parts):
        got.append(bytes(piece))
        most = max(most, _mapped_rss_kib(m) * 1024)
    assert b"".join(got) == whole
    slack = 4 << 20  # pages mapped around a fault (huge pages, where the file system has them)
    assert most <= RELEASE_SLICE + slack  # one slice at a time, not the whole column
    assert _mapped_rss_kib(m) * 1024 <= slack
    assert deflate(_released(parts)) == deflate([whole])


def test_a_raw_column_is_stored_in_place() -> None:
    """A column stored raw (bytes a value, or values no narrower width holds) goes to the
    compressor as its own bytes, not packed into a copy (a DeepSeek-V3 explain column is
    93 MB), and the parts still join to the table's msgpack."""
    from schemas.table import Table

    n = 1000
    t = Table.build((("k", "<u1"), ("big", "<i8"), ("small", "<i8")), k=np.arange(n) % 7,
                    big=np.arange(n) << 40, small=np.arange(n))
    parts = list(_expanded(_parts(_Stored(t))))
    for col in t.columns[:2]:  # raw: some part is the column itself
        assert any(isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), col)
                   for p in parts)
    assert b"".join(bytes(p) for p in parts) == pack(t.stored())


def test_known_ranges_and_reused_buffers_give_the_same_bytes() -> None:
    """A `RangedTable`'s columns are stored from the ranges it carries (a wrong range gives
    another form: they are read, not recomputed), in the same bytes as the plain table's;
    and narrowed slices made in one set of buffers for blob after blob (`_Buffers`)
    compress to what the columns' own msgpack does."""
    from schemas.plan_write import _Buffers
    from schemas.table import RangedTable, Table

    schema = (("a", "<i8"), ("b", "<i4"), ("c", "<i8"))
    rng = np.random.default_rng(2)
    n = RELEASE_SLICE // 4 + 777  # (more than one slice of the int32 column)
    cols = {"a": rng.integers(-5, 100, n), "b": rng.integers(0, 30000, n).astype(np.int32),
            "c": rng.integers(0, 1 << 40, n)}
    plain = Table.build(schema, **cols)
    spans = tuple((int(c.min()), int(c.max())) for c in plain.columns)
    ranged = RangedTable(schema, plain.columns, spans)
    want = pack(plain.stored())
    assert b"".join(bytes(p) for p in _expanded(_parts(_Stored(ranged)))) == want
    wrong = RangedTable(schema, plain.columns, ((0, 1 << 40), *spans[1:]))
    assert b"".join(bytes(p) for p in _expanded(_parts(_Stored(wrong)))) != want
    buffers = _Buffers()
    other = Table.build(schema, **{k: v[:1000] * 3 for k, v in cols.items()})
    for t in (plain, other, plain):  # one set of buffers, blob after blob
        assert deflate(_released(_parts(_Stored(t)), buffers)) == deflate([pack(t.stored())])
