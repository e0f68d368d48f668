"""`planner.tools.planfile.explain_streamed`: the tools check a large plan's explain blob one
table column at a time. It vouches for exactly the blobs the whole decode accepts: a
written plan's blob passes (the streamed path is the one that runs), and a blob the whole
decode refuses is never vouched for (the caller then decodes it whole and says why)."""

from __future__ import annotations

import struct

import msgpack
import pytest

from planner.tools.planfile import PlanFile, explain_streamed
from schemas.errors import PlanFormatError
from schemas.plan import EXPLAIN_COLUMNS, decode_explain
from schemas.plan_codec import FRAME, deflate
from tests.support.plans import save, two_by_two


def _check(blob: bytes, monkeypatch, path: str) -> bool:
    """`explain_streamed` of `path` with its explain blob's stored bytes replaced."""
    import schemas.plan_codec as codec

    src = PlanFile(path)
    real = codec.read_exact

    def fake(f, n, what, digest=None):
        return blob if "explain" in what else real(f, n, what, digest)

    monkeypatch.setattr("planner.tools.planfile.read_exact", fake)
    try:
        return explain_streamed(src.f, src.header, src.start, path)
    finally:
        src.close()


def test_a_written_plans_explain_is_vouched_for(tmp_path):
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    with PlanFile(path) as src:
        assert explain_streamed(src.f, src.header, src.start, path)
        decode_explain(src.blob("explain"), path)  # and the whole decode agrees


@pytest.mark.parametrize("obj", [
    {"tensors": ["a"], "table": [b""] * (len(EXPLAIN_COLUMNS) - 1)},  # a column short
    {"tensors": ["a", 3], "table": [b""] * len(EXPLAIN_COLUMNS)},  # a name not a string
    {"tensors": ["a"], "table": [b"\0" * 4] * len(EXPLAIN_COLUMNS)},  # half an int64 row
    {"tensors": ["a"]},  # no table
    ["tensors"],  # not a map
])
def test_what_the_whole_decode_refuses_is_never_vouched_for(tmp_path, monkeypatch, obj):
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    raw = msgpack.packb(obj, use_bin_type=True)
    with pytest.raises(PlanFormatError):
        decode_explain(msgpack.unpackb(raw, raw=False), path)
    assert not _check(deflate([raw]), monkeypatch, path)
    # and the same stream declaring one byte more, or with a byte after it
    bad = FRAME + struct.pack("<Q", len(raw) + 1) + deflate([raw])[len(FRAME) + 8:]
    assert not _check(bad, monkeypatch, path)
    good = {"tensors": ["a"], "table": [b""] * len(EXPLAIN_COLUMNS)}
    assert _check(deflate([msgpack.packb(good, use_bin_type=True)]), monkeypatch, path)
    assert not _check(deflate([msgpack.packb(good, use_bin_type=True) + b"\x00"]), monkeypatch,
                      path)


def test_a_mutated_blob_gets_an_answer_never_an_exception(tmp_path, monkeypatch):
    """Bytes flipped, cut or appended anywhere in a valid blob: the streamed check answers
    True or False (the whole decode then speaks), whatever the damage."""
    import random

    path = save(str(tmp_path / "p.rplan"), two_by_two())
    with PlanFile(path) as src:  # the written plan's own explain blob, as stored
        entry = src.header.blobs["explain"]
        src.f.seek(src.start + entry.offset)
        blob = src.f.read(entry.length)
    assert _check(blob, monkeypatch, path)
    rng = random.Random(7)
    for _ in range(300):
        b = bytearray(blob)
        kind = rng.randrange(3)
        if kind == 0:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind == 1:
            del b[rng.randrange(len(b)):]
        else:
            b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        assert _check(bytes(b), monkeypatch, path) in (True, False)
