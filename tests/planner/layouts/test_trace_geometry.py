"""The geometry of one recorded copy, written out by hand (no torch, no vLLM)."""

from __future__ import annotations

import pytest

from planner.errors import TraceError
from planner.layouts.base import Piece
from planner.layouts.trace_geometry import View, piece


def test_row_slice_into_a_fused_tensor() -> None:
    # k_proj [8, 16]: rows 4..8 (narrow(0, 4, 4): offset 4*16, strides (16, 1)) copied into
    # qkv_proj [24, 16] at rows 16..20 (offset 16*16).
    got = piece("k", (8, 16), View((4, 16), (16, 1), 64), View((4, 16), (16, 1), 256),
                (24, 16), "qkv")
    assert got == Piece("k", (4, 0), (4, 16), (16, 0))


def test_column_slice_of_a_row_parallel_weight() -> None:
    # o_proj [16, 32], columns 24..32 (narrow(1, 24, 8): offset 24, strides (32, 1)) into
    # the whole local [16, 8].
    got = piece("o", (16, 32), View((16, 8), (32, 1), 24), View((16, 8), (8, 1), 0),
                (16, 8), "o_local")
    assert got == Piece("o", (0, 24), (16, 8), (0, 0))


def test_an_expert_into_a_stacked_tensor() -> None:
    # up_proj of expert 2 [8, 16] -> w13 [4, 16, 16] at [2, 8:16, :] (offset 2*256 + 8*16)
    got = piece("up", (8, 16), View((8, 16), (16, 1), 0), View((8, 16), (16, 1), 640),
                (4, 16, 16), "w13")
    assert got == Piece("up", (0, 0), (8, 16), (2, 8, 0))
    assert got.phys_sizes() == (1, 8, 16)


def test_a_transposed_copy_maps_dims() -> None:
    # w [4, 6] copied transposed (strides (1, 6)) into p [6, 4]: logical dim 0 runs along
    # physical dim 1
    got = piece("w", (4, 6), View((6, 4), (1, 6), 0), View((6, 4), (4, 1), 0), (6, 4), "p")
    assert got == Piece("w", (0, 0), (4, 6), (0, 0), dims=(1, 0))


@pytest.mark.parametrize("src,dst,why", [
    (View((4, 4), (0, 1), 0), View((4, 4), (4, 1), 0), "not a box"),  # broadcast rows
    (View((2, 4), (8, 1), 0), View((2, 4), (4, 1), 0), "not a box"),  # every other row
    (View((4,), (1,), 0), View((4, 4), (4, 1), 0), "broadcasts"),
])
def test_what_is_not_a_box_is_refused(src: View, dst: View, why: str) -> None:
    with pytest.raises(TraceError, match=why):
        piece("w", (4, 4), src, dst, (4, 4), "p")
