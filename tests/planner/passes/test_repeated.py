"""Alike replicas' target pieces and chunks held once (`intersect.Repeated`: `alike`,
`first_block`, `repeat_block`), read
through their first copy (`lower_cols.Chosen`), and copy columns of one value held as that
value (`lower_cols.constant`): each read gives what the whole column gives."""

from __future__ import annotations

import numpy as np
import pytest

from planner.layouts import megatron, vllm
from planner.passes.assign import assign
from planner.passes.intersect import (
    Repeated,
    alike,
    boxes,
    first_block,
    intersect,
    piece_table,
    repeat_block,
    table_and_boxes,
)
from planner.passes.lower_cols import chosen, concat, constant, is_constant
from planner.spec import spec_from_hf
from planner.topology import build_topology
from schemas.config import ClusterConfig, SourceConfig, TargetConfig
from tests.support.models import qwen3_moe


def _tables(replicas: int, with_src: bool = False):
    """The chunks and the target pieces of a qwen3-MoE refit to `replicas` alike vLLM
    replicas, as whole columns (and, `with_src`, the source pieces)."""
    spec, src, dst_layout, world = _layouts(replicas)
    dst = piece_table(dst_layout, spec, world)
    if with_src:
        return intersect(spec, src, dst), dst, src
    return intersect(spec, src, dst), dst


def _held_once(replicas: int):
    """The chunks and target pieces of `_tables(replicas)` as the compiler holds them: the
    target table made once (`table_and_boxes`), the first replica's pieces alone
    intersected (`alike`, `first_block`) and their chunks repeated (`repeat_block`); and
    those first chunks."""
    spec, src, dst_layout, world = _layouts(replicas)
    dst, found = table_and_boxes(dst_layout, spec, world)
    one, one_boxes = first_block(dst, found, alike(dst, replicas))
    first = intersect(spec, src, one, one_boxes)
    return (*repeat_block(first, dst, replicas), first)


def _layouts(replicas: int):
    spec = spec_from_hf(qwen3_moe())
    src_layout = megatron.layout(spec, SourceConfig(framework="megatron", tp=2, dp=2, pp=2))
    dst_layout = vllm.layout(spec, TargetConfig(engine="vllm", tp=2, replicas=replicas))
    return spec, piece_table(src_layout, spec, 0), dst_layout, src_layout.world


def test_alike_replicas_table_is_made_once() -> None:
    """`table_and_boxes` of alike replicas: `Repeated` columns equal to the whole table's;
    the chunks of the first replica's pieces, repeated, are the whole table's chunks."""
    spec, src, dst_layout, world = _layouts(3)
    whole = piece_table(dst_layout, spec, world)
    dst, found = table_and_boxes(dst_layout, spec, world)
    n = alike(dst, 3)
    assert n == len(whole) // 3 and alike(whole, 3) == n and alike(whole, 2) == 0
    for f in whole.__slots__:
        col = getattr(dst, f)
        assert isinstance(col, Repeated) and np.array_equal(np.asarray(col), getattr(whole, f))
    assert np.array_equal(np.asarray(found.of), boxes(whole).of)
    assert np.array_equal(found.first, boxes(whole).first)
    one, one_boxes = first_block(dst, found, n)
    chunks, pieces = repeat_block(intersect(spec, src, one, one_boxes), dst, 3)
    want = intersect(spec, src, whole)
    for f in ("tensor", "off0", "off1", "size0", "size1", "dst", "sbox"):
        assert np.array_equal(np.asarray(getattr(chunks, f)), getattr(want, f)), f
    for f in whole.__slots__:
        assert np.array_equal(np.asarray(getattr(pieces, f)), getattr(whole, f)), f


def test_repeated_columns_read_as_the_whole_columns() -> None:
    chunks, dst = _tables(3)
    r_chunks, r_dst, first = _held_once(3)
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
    assert r_chunks.holders is first.holders and r_chunks.holder_ptr is first.holder_ptr
    assert np.array_equal(r_chunks.holders, chunks.holders)
    assert np.array_equal(r_chunks.holder_ptr, chunks.holder_ptr)


@pytest.mark.parametrize("change", ["rank", "size0"])
def test_replicas_not_alike_are_not_repeated(change: str) -> None:
    _, dst = _tables(2)
    col = getattr(dst, change).copy()
    col[len(col) - 1] += 1  # the last replica's last piece differs
    other = dst.__class__(**{f: col if f == change else getattr(dst, f)
                             for f in dst.__slots__})
    assert alike(other, 2) == 0
    assert alike(dst, 2) != 0
    assert alike(dst, 1) == 0


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


def test_chosen_reads_alike_copies_as_the_whole_columns() -> None:
    # 3 alike replicas of TP 2 (6 target ranks) fed by 8 source ranks (TP 2, DP 2, PP 2: two
    # candidates for each box): `assign` on the copies held once picks what it picks on the
    # whole columns, and every read through `Chosen` (slices in one copy and across copies,
    # ascending rows in one copy and in several, a reordered `take`) gives the whole
    # columns' values and dtypes.
    chunks, dst, src = _tables(3, with_src=True)
    r_chunks, r_dst, _ = _held_once(3)
    topo = build_topology(ClusterConfig(gpus_per_host=4, nics_per_host=2), 8, 6)
    choice = assign(chunks, src, dst, topo)
    assert np.array_equal(assign(r_chunks, src, r_dst, topo), choice)
    assert len(np.unique(src.rank[choice])) > 4  # both candidates of a box are picked
    whole, held = chosen(chunks, choice, src, dst), chosen(r_chunks, choice, src, r_dst)
    assert held.per_copy == len(chunks) // 3 and whole.per_copy == len(chunks)
    n, m = len(chunks), len(chunks) // 3
    rng = np.random.default_rng(1)
    picks = [slice(0, n), slice(m + 2, 2 * m - 1), slice(m - 5, m + 5), slice(3, 3),
             np.sort(rng.choice(n, n // 3, replace=False)), np.arange(m, 2 * m, 3),
             np.zeros(0, dtype=np.int64)]
    for which in picks:
        for a, b in ((whole.at(which), held.at(which)),
                     (whole.at(which).take(np.arange(len(whole.at(which)))[::-1]),
                      held.at(which).take(np.arange(len(held.at(which)))[::-1]))):
            assert len(a) == len(b)
            for name in ("tensor", "off0", "off1", "size0", "size1"):
                x, y = whole.chunk(name, a), held.chunk(name, b)
                assert np.array_equal(x, y) and x.dtype == y.dtype, (name, which)
            for name in dst.__slots__:
                x, y = whole.target(name, a), held.target(name, b)
                assert np.array_equal(x, y) and x.dtype == y.dtype, (name, which)
            for name in ("rank", "region", "base"):
                assert np.array_equal(whole.source(name, a), held.source(name, b))
            for source in (True, False):
                assert np.array_equal(whole.start(a, source), held.start(b, source))


def test_bytes_in_of_alike_replicas_is_the_whole_tables() -> None:
    """`compiler._bytes_in` of `Repeated` target pieces (the first copy's bytes, moved by
    each copy's step) equals its sum over the whole table's rows."""
    from planner.compiler import _bytes_in

    spec, _, dst_layout, world = _layouts(3)
    whole = piece_table(dst_layout, spec, world)
    dst, _ = table_and_boxes(dst_layout, spec, world)
    assert isinstance(dst.rank, Repeated) and dst.rank.step > 0
    n = world + dst_layout.world
    got, want = _bytes_in(dst, n), _bytes_in(whole, n)
    assert want[world:].min() > 0 and want[:world].max() == 0  # every target receives
    assert got.dtype == want.dtype and np.array_equal(got, want)
