"""The plan fingerprint (`passes/emit.fingerprint`) digests the piece tables by value: the
integer type a column is held in does not change it, any value that differs does (a value
beyond int32 too, and the same values in another column), as does anything else it covers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from planner.frameworks import build_layout
from planner.passes.emit import fingerprint, rank_regions, tensor_regions
from planner.passes.intersect import PieceTable, piece_table
from planner.topology import build_topology
from planner.validate import load

DEMO = Path(__file__).parents[3] / "plans" / "demo.yaml"


@pytest.fixture(scope="module")
def parts():
    cfg, spec = load(str(DEMO))
    src_layout, dst_layout = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    src, dst = piece_table(src_layout, spec, 0), piece_table(dst_layout, spec, src_layout.world)
    regions = rank_regions(tensor_regions(src_layout), tensor_regions(dst_layout))
    topo = build_topology(cfg.cluster, src_layout.world, dst_layout.world)
    return cfg, spec, src, dst, regions, topo


def _fp(parts, src: PieceTable | None = None, dst: PieceTable | None = None) -> str:
    cfg, spec, s, d, regions, topo = parts
    return fingerprint(spec, src or s, dst or d, regions, topo, cfg)


def _cast(t: PieceTable, dtype: type) -> PieceTable:
    return PieceTable(*(getattr(t, f.name).astype(dtype) for f in dataclasses.fields(t)))


def _with(t: PieceTable, name: str, col: np.ndarray) -> PieceTable:
    return dataclasses.replace(t, **{name: col})


def test_the_integer_type_holding_a_column_does_not_change_it(parts) -> None:
    _, _, src, dst, _, _ = parts
    assert src.rank.dtype == np.int32  # the demo's tables are held as int32
    want = _fp(parts)
    assert len(want) == 32 and int(want, 16) >= 0
    assert _fp(parts, _cast(src, np.int64), _cast(dst, np.int64)) == want
    narrow = _with(_with(dst, "rank", dst.rank.astype(np.int16)), "dtype",
                   dst.dtype.astype(np.uint8))  # (their values fit)
    assert np.array_equal(narrow.rank, dst.rank) and np.array_equal(narrow.dtype, dst.dtype)
    assert _fp(parts, dst=narrow) == want
    strided = PieceTable(*(np.repeat(getattr(dst, f.name), 2)[::2]  # not contiguous
                           for f in dataclasses.fields(dst)))
    assert not strided.rank.flags.c_contiguous
    assert _fp(parts, dst=strided) == want


def test_any_value_changes_it(parts) -> None:
    _, _, src, dst, _, _ = parts
    want = _fp(parts)
    seen = {want}
    for name in ("rank", "base", "a1", "dtype"):
        col = getattr(dst, name).astype(np.int64)
        col[len(col) // 2] += 1
        seen.add(_fp(parts, dst=_with(dst, name, col)))
    big = src.base.astype(np.int64)
    big[0] += 1 << 32  # the same low 32 bits: hashed as int64, it differs
    seen.add(_fp(parts, src=_with(src, "base", big)))
    # the same values in other columns (two columns swapped)
    seen.add(_fp(parts, dst=dataclasses.replace(dst, size0=dst.size1, size1=dst.size0)))
    # the source's and target's rows told apart
    seen.add(_fp(parts, src=dst, dst=src))
    assert len(seen) == 8
