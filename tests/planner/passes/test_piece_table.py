"""The piece table: columns (`PieceColumns`) read as the pieces they stand for, the
boxes `table_and_boxes` finds among distinct ranks equal to those of the whole table, and
the box join `route` hands on to `intersect` (`join`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner.fp8 import quantize_layout, with_scales
from planner.layouts import megatron, vllm
from planner.layouts.base import Layout, PieceColumns, RankLayout
from planner.passes.intersect import (
    Repeated,
    boxes,
    intersect,
    join,
    keep_boxes,
    keep_pairs,
    piece_table,
    table_and_boxes,
    take,
)
from planner.passes.route import route
from planner.spec import spec_from_hf
from planner.topology import build_topology
from schemas.config import ClusterConfig, ConfigError, Options, SourceConfig, TargetConfig
from tests.support.models import deepseek_v3, qwen3_moe


def _as_tuples(layout: Layout) -> Layout:
    """The same layout with every `PieceColumns` made a tuple of `Piece`s (fresh objects:
    nothing shared between ranks)."""
    ranks = tuple(RankLayout(r.rank, r.replica, tuple(
        dataclasses.replace(pt, pieces=tuple(pt.pieces)) for pt in r.tensors))
        for r in layout.ranks)
    return dataclasses.replace(layout, ranks=ranks)


def _columns(layout: Layout) -> int:
    return sum(isinstance(pt.pieces, PieceColumns) for r in layout.ranks for pt in r.tensors)


@pytest.mark.parametrize("hf, cfg", [
    (qwen3_moe(), TargetConfig(engine="vllm", tp=2, replicas=3)),
    (qwen3_moe(), TargetConfig(engine="vllm", tp=2, dp=2, ep=True, replicas=2)),
    (deepseek_v3(), TargetConfig(engine="vllm", tp=2, replicas=2, w13_order="w3w1")),
])
def test_columns_give_the_table_of_their_pieces(hf, cfg) -> None:
    spec = spec_from_hf(hf)
    lay = vllm.layout(spec, cfg)
    assert _columns(lay) > 0  # the experts are columns
    plain = _as_tuples(lay)
    assert _columns(plain) == 0 and plain == lay  # equal, tuple or columns
    a, b = piece_table(lay, spec, 5), piece_table(plain, spec, 5)
    for f in a.__slots__:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
        assert getattr(a, f).flags.c_contiguous


@pytest.mark.parametrize("replicas", [1, 3])
def test_boxes_from_distinct_ranks_equal_the_whole_tables(replicas: int) -> None:
    spec = spec_from_hf(qwen3_moe())
    lay = vllm.layout(spec, TargetConfig(engine="vllm", tp=2, replicas=replicas))
    # PP 2 after DP 2: the second stage's ranks come after replicas of the first
    src = megatron.layout(spec, SourceConfig(framework="megatron", tp=2, dp=2, pp=2))
    for layout in (lay, src, _as_tuples(lay)):
        table, found = table_and_boxes(layout, spec, 7)
        want = boxes(table)
        assert np.array_equal(found.of, want.of) and np.array_equal(found.first, want.first)
    # and intersect gives the same chunks with or without them
    s = piece_table(src, spec, 0)
    table, found = table_and_boxes(lay, spec, src.world)
    x, y = intersect(spec, s, table, found), intersect(spec, s, table)
    for f in x.__slots__:
        assert np.array_equal(getattr(x, f), getattr(y, f)), f


def test_unknown_tensor_in_columns_is_named() -> None:
    spec = spec_from_hf(qwen3_moe())
    lay = vllm.layout(spec, TargetConfig(engine="vllm", tp=2))
    r = lay.ranks[0]
    i, pt = next((i, pt) for i, pt in enumerate(r.tensors)
                 if isinstance(pt.pieces, PieceColumns))
    c = pt.pieces
    bad = PieceColumns(("no.such.tensor", *c.names[1:]), c.offsets, c.sizes, c.at, c.dims)
    tensors = (*r.tensors[:i], dataclasses.replace(pt, pieces=bad), *r.tensors[i + 1:])
    broken = dataclasses.replace(lay, ranks=(dataclasses.replace(r, tensors=tensors),))
    with pytest.raises(ValueError, match="no.such.tensor"):
        piece_table(broken, spec, 0)


def _fp8_moe(**kw: int) -> dict:
    """Heads of 128 rows: attention shards stay on the 128-block grid."""
    return qwen3_moe(hidden_size=256, intermediate_size=256, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=128, **kw)


def test_fp8_scales_of_columns_equal_those_of_their_pieces() -> None:
    # TP 1 (experts over EP 2): every box whole, so block-aligned
    spec = spec_from_hf(_fp8_moe(moe_intermediate_size=256))
    lay = vllm.layout(spec, TargetConfig(engine="vllm", tp=1, dp=2, ep=True))
    cols, plain = quantize_layout(lay, spec), quantize_layout(_as_tuples(lay), spec)
    assert _columns(cols) > _columns(lay)  # the scales of columns are columns
    assert cols == plain


def test_fp8_misaligned_columns_are_refused_naming_the_piece() -> None:
    # attention split by whole 128-row heads; experts' 192 rows over TP 2: 96 per rank
    spec = spec_from_hf(_fp8_moe(moe_intermediate_size=192))
    lay = vllm.layout(spec, TargetConfig(engine="vllm", tp=2))
    with pytest.raises(ConfigError, match=r"w13_weight holds model\.layers\.0\.mlp\.experts\.0"):
        quantize_layout(lay, spec)


def test_columns_are_int32_only_where_every_offset_fits() -> None:
    """int32 columns when values and element offsets fit; a box whose offsets reach past
    2**31 elements (base + off0 * a0) keeps the table int64."""
    from planner.passes.intersect import _column_dtype

    row = np.array([[0], [0], [0], [0], [4], [8], [0], [8], [1], [1]], dtype=np.int64)
    assert _column_dtype([row], 16) == np.int32
    far = row.copy()
    far[2], far[7] = 1 << 20, 1 << 12  # off0 * a0 = 2**32
    far[6] = -(1 << 32) + 5
    assert _column_dtype([row, far], 16) == np.int64
    spec = spec_from_hf(qwen3_moe())
    table = piece_table(vllm.layout(spec, TargetConfig(engine="vllm", tp=2)), spec, 0)
    assert all(getattr(table, f).dtype == np.int32 for f in table.__slots__)


@pytest.mark.parametrize("src_tp", [2, 4])
def test_join_handed_on_gives_the_chunks_of_a_fresh_intersect(src_tp: int) -> None:
    """`join` of the distinct boxes, less some boxes (`keep_pairs`, `keep_boxes`), handed to
    `intersect` gives the chunks `intersect` makes of the kept rows itself (source TP 4:
    target boxes cut in two, the pairs expanded to rows; TP 2: one source box each)."""
    spec = spec_from_hf(qwen3_moe())
    lay = vllm.layout(spec, TargetConfig(engine="vllm", tp=2, replicas=2))
    src = piece_table(megatron.layout(spec, SourceConfig(framework="megatron", tp=src_tp,
                                                         dp=2)), spec, 0)
    table, found = table_and_boxes(lay, spec, 64)
    pairs = join(spec, src, table, found)
    assert np.array_equal(np.unique(pairs.dst), np.arange(len(found.first)))
    assert (len(pairs) > len(found.first)) == (src_tp == 4)
    keep = np.asarray(table.tensor) % 3 != 1  # (whole boxes: a box is of one tensor)
    kept = take(table, np.flatnonzero(keep))
    got = intersect(spec, src, kept, keep_boxes(found, keep),
                    keep_pairs(pairs, keep[found.first]))
    want = intersect(spec, src, kept)
    for f in want.__slots__:
        x, y = np.asarray(getattr(got, f)), np.asarray(getattr(want, f))
        assert np.array_equal(x, y) and x.dtype == y.dtype, f


def test_fp8_replicas_are_alike() -> None:
    """An FP8 layout's replicas (ranks of tuples of the same tensors, not one tuple) are
    made once (`Repeated`), and equal the whole table; `route` of it gives what it gives of
    the whole table."""
    spec = with_scales(spec_from_hf(_fp8_moe(moe_intermediate_size=256)))
    lay = quantize_layout(vllm.layout(spec, TargetConfig(engine="vllm", tp=1, dp=2, ep=True,
                                                         replicas=3)), spec)
    assert lay.ranks[2].tensors is not lay.ranks[0].tensors
    src = megatron.layout(spec, SourceConfig(framework="megatron", tp=2, dp=2))
    s = piece_table(src, spec, 0)
    held, found = table_and_boxes(lay, spec, src.world)
    whole = piece_table(lay, spec, src.world)
    assert isinstance(held.rank, Repeated) and held.rank.times == 3
    for f in whole.__slots__:
        assert np.array_equal(np.asarray(getattr(held, f)), getattr(whole, f)), f
    topo = build_topology(ClusterConfig(gpus_per_host=4, nics_per_host=2), src.world, 6)
    opts = Options()
    a, b = route(spec, s, held, opts, topo, found), route(spec, s, whole, opts, topo)
    assert len(a.gathered) and len(a.scales) and len(a.direct)
    assert isinstance(a.direct.rank, Repeated)  # the plain rows, each copy's held once
    for f in ("gathered", "scales"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    for f in whole.__slots__:
        assert np.array_equal(np.asarray(getattr(a.direct, f)), getattr(b.direct, f)), f
    assert a.direct_boxes is not None and b.direct_boxes is not None
    assert np.array_equal(np.asarray(a.direct_boxes.of), b.direct_boxes.of)
    assert np.array_equal(a.direct_boxes.first, b.direct_boxes.first)
