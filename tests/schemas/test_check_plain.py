"""`check_plain` (a blob checked, nothing kept) accepts and refuses exactly what `unpack`
accepts and refuses, with the same message."""

from __future__ import annotations

import random

import msgpack
import pytest

from schemas.errors import PlanFormatError
from schemas.plan_codec import check_plain, pack, unpack

GOOD = pack({"names": ["a.weight", "b.bias"], "shapes": [[3, 4], [4]], "buffer": b"\x00\x01",
             "pieces": [b"\x01" * 16, b"\x02" * 8], "same_as": None, "f": 1.5, "t": True})
ODD = [
    msgpack.packb({1: "int key"}),
    msgpack.packb({(1, 2): "array key"}),
    msgpack.packb([msgpack.ExtType(5, b"xx")]),
    msgpack.packb({"when": msgpack.Timestamp(1, 2)}, datetime=False),
    b"\x81\xa1a\xa2\xff\xfe",  # {"a": invalid UTF-8}
    b"\x92\x01",  # an array cut short
    GOOD + b"\x00",  # a value after the end
    b"\xc1",  # the byte msgpack never uses
    b"",
]


def _outcome(fn, data: bytes) -> str:
    try:
        fn(data, "blob")
    except PlanFormatError as e:
        return str(e)
    return "ok"


@pytest.mark.parametrize("data", [GOOD, *ODD])
def test_check_plain_decides_as_unpack(data):
    assert _outcome(check_plain, data) == _outcome(unpack, data)


def test_check_plain_decides_as_unpack_on_flipped_and_cut_blobs():
    rng = random.Random(7)
    seen = set()
    for _ in range(400):
        b = bytearray(GOOD)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        data = bytes(b[:rng.randint(1, len(b))] if rng.random() < 0.3 else b)
        got = _outcome(check_plain, data)
        assert got == _outcome(unpack, data), data
        seen.add(got == "ok")
    assert seen == {True, False}  # both outcomes were met
