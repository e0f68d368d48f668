"""Alike replicas' target pieces and chunks held once (`intersect.Repeated`, `repeated`) and
copy columns of one value held as that value (`lower_cols.constant`): each read gives what
the whole column gives."""

from __future__ import annotations

import numpy as np
import pytest

from planner.layouts import megatron, vllm
from planner.passes.intersect import Repeated, intersect, piece_table, repeated, table_and_boxes
from planner.passes.lower_cols import concat, constant, is_constant
from planner.spec import spec_from_hf
from schemas.config import SourceConfig, TargetConfig
from tests.support.models import qwen3_moe


def _tables(replicas: int):
    spec = spec_from_hf(qwen3_moe())
    src_layout = megatron.layout(spec, SourceConfig(framework="megatron", tp=2, dp=2, pp=2))
    src = piece_table(src_layout, spec, 0)
    dst, found = table_and_boxes(
        vllm.layout(spec, TargetConfig(engine="vllm", tp=2, replicas=replicas)), spec,
        src_layout.world)
    return intersect(spec, src, dst, found), dst


def test_repeated_columns_read_as_the_whole_columns() -> None:
    chunks, dst = _tables(3)
    got = repeated(chunks, dst, 3)
    assert got is not None
    r_chunks, r_dst = got
    n, rng = len(dst), np.random.default_rng(0)
    rows = rng.integers(0, n, 1000)
    for f in dst.__slots__:
        whole, col = getattr(dst, f), getattr(r_dst, f)
        assert isinstance(col, Repeated) and len(col) == n
        assert np.array_equal(np.asarray(col), whole), f
        assert np.array_equal(col[rows], whole[rows]), f
        assert np.array_equal(col[rows.astype(np.int32)], whole[rows]), f
        for lo, hi in ((0, n), (5, n // 3 + 7), (n // 3, 2 * n // 3), (n - 1, n), (4, 4)):
            assert np.array_equal(col[lo:hi], whole[lo:hi]), (f, lo, hi)
            assert col[lo:hi].dtype == whole.dtype
        assert np.array_equal(col[whole % 2 == 0], whole[whole % 2 == 0]), f
        assert col.min() == whole.min() and col.max() == whole.max(), f
        assert np.array_equal(col * 2 + 1, whole * 2 + 1), f
    for f in ("tensor", "off0", "off1", "size0", "size1", "dst", "sbox"):
        assert np.array_equal(np.asarray(getattr(r_chunks, f)), getattr(chunks, f)), f
    assert r_chunks.holders is chunks.holders and r_chunks.holder_ptr is chunks.holder_ptr


@pytest.mark.parametrize("change", ["rank", "size0"])
def test_replicas_not_alike_are_not_repeated(change: str) -> None:
    chunks, dst = _tables(2)
    col = getattr(dst, change).copy()
    col[len(col) - 1] += 1  # the last replica's last piece differs
    other = dst.__class__(**{f: col if f == change else getattr(dst, f)
                             for f in dst.__slots__})
    assert repeated(chunks, other, 2) is None
    assert repeated(chunks, dst, 2) is not None
    assert repeated(chunks, dst, 1) is None


def test_constant_columns_are_one_value() -> None:
    same = np.full(10, 7, dtype=np.int32)
    c = constant(same)
    assert is_constant(c) and np.array_equal(c, same) and not c.flags.writeable
    varied = np.arange(10, dtype=np.int32)
    assert constant(varied) is varied and not is_constant(varied)
    assert is_constant(concat(c, np.zeros(0, np.int64)))  # the other part empty
    assert concat(c, np.zeros(0, np.int64)).dtype == np.int64
    assert is_constant(concat(c, constant(np.full(3, 7, np.int32))))
    both = concat(c, constant(np.full(3, 8, np.int32)))
    assert not is_constant(both) and np.array_equal(both, [7] * 10 + [8] * 3)
