"""`write_plan`'s file is `encode_plan`'s bytes (compact and plain), and `_parts` (tables'
column bytes left in place) joins to msgpack's own packing."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from planner.compiler import compile_config
from planner.validate import load
from schemas.plan_codec import pack
from schemas.plan_write import _parts, encode_plan, write_plan

ROOT = Path(__file__).resolve().parents[2]


def test_parts_join_to_msgpack() -> None:
    for n in (0, 1, 255, 256, 65535, 65536, 70000):
        col = memoryview(np.arange(n, dtype=np.uint8))
        for obj in ({"t": [col, col], "n": 3, "rows": [[1, "x"]], "e": []}, [col], {}):
            assert b"".join(bytes(p) for p in _parts(obj)) == pack(obj)


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
