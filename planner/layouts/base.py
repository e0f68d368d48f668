"""The layout vocabulary: pieces of logical tensors inside each rank's physical tensors.

A `Layout` says, for one side (source framework or target engine) and one parallel config,
which physical tensors every rank holds under its native name, and where each box of a
logical tensor sits inside them. Fused tensors (`linear_qkv`, `qkv_proj`, `w13_weight`)
are several pieces; replicas hold the same boxes; padding rows are covered by no piece.

Geometry of a piece: the logical box `offsets`/`sizes` (one entry per logical dim) lands
in the physical tensor at `at` (one entry per physical dim). Logical dim i runs along
physical dim `dims[i]`; physical dims not in `dims` have extent 1 (the expert index of a
stacked `w13_weight`). `dims` defaults to the trailing physical dims in order, so a
transposed weight is `dims=(1, 0)`.

Many pieces alike (a rank's stacked experts: one piece per expert) are one `PieceColumns`:
the same pieces as integer columns, built with numpy; it is a sequence of `Piece`s (made
when read), equal to the tuple of the same pieces, and `intersect.piece_table` reads its
columns without making any.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, overload

import numpy as np


@dataclass(frozen=True, slots=True)
class Piece:
    tensor: str
    """Logical tensor name (checkpoint name)."""
    offsets: tuple[int, ...]
    """Start of the box in the logical tensor, per logical dim."""
    sizes: tuple[int, ...]
    """Extent of the box, per logical dim."""
    at: tuple[int, ...]
    """Where the box's first element sits in the physical tensor, per physical dim."""
    dims: tuple[int, ...] | None = None
    """Physical dim of each logical dim; None: the trailing physical dims, in order."""

    def phys_dims(self) -> tuple[int, ...]:
        if self.dims is not None:
            return self.dims
        lead = len(self.at) - len(self.sizes)
        return tuple(range(lead, len(self.at)))

    def phys_sizes(self) -> tuple[int, ...]:
        """Extent of the box in the physical tensor, per physical dim."""
        out = [1] * len(self.at)
        for size, d in zip(self.sizes, self.phys_dims()):
            out[d] = size
        return tuple(out)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


class PieceColumns(Sequence[Piece]):
    """Pieces of one physical tensor as columns: piece i is `Piece(names[i], offsets[i],
    sizes[i], at[i], dims)` (every piece has the same number of logical and physical dims
    and the same `dims`). Read-only; equal to any sequence of the same pieces."""

    __slots__ = ("names", "offsets", "sizes", "at", "dims")

    def __init__(self, names: Sequence[str], offsets: np.ndarray, sizes: np.ndarray,
                 at: np.ndarray, dims: tuple[int, ...] | None = None) -> None:
        n = len(names)
        cols = [np.array(c, dtype=np.int64, ndmin=2) if n else np.zeros((0, 0), np.int64)
                for c in (offsets, sizes, at)]
        if any(len(c) != n for c in cols) or cols[0].shape != cols[1].shape:
            raise ValueError(f"PieceColumns: {n} names, columns of shapes "
                             f"{[c.shape for c in cols]}")
        for c in cols:
            c.flags.writeable = False
        self.names: tuple[str, ...] = tuple(names)
        self.offsets, self.sizes, self.at = cols
        self.dims = dims

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, i: int) -> Piece: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Piece, ...]: ...

    def __getitem__(self, i: int | slice) -> Piece | tuple[Piece, ...]:
        if isinstance(i, slice):
            return tuple(self)[i]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return Piece(self.names[i], tuple(self.offsets[i].tolist()),
                     tuple(self.sizes[i].tolist()), tuple(self.at[i].tolist()), self.dims)

    def __iter__(self) -> Iterator[Piece]:
        for name, off, size, at in zip(self.names, self.offsets.tolist(),
                                       self.sizes.tolist(), self.at.tolist()):
            yield Piece(name, tuple(off), tuple(size), tuple(at), self.dims)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PieceColumns({len(self)} pieces)"


@dataclass(frozen=True, slots=True)
class PhysicalTensor:
    name: str
    """Native name, as `named_parameters()` (or `named_buffers()`) gives it on that rank."""
    shape: tuple[int, ...]
    """Local shape on that rank."""
    dtype: str
    """Local dtype (`bfloat16`, `float32`, ...)."""
    pieces: tuple[Piece, ...] | PieceColumns
    """The logical boxes it holds; elements covered by no piece are padding (zeros)."""
    buffer: bool = False
    """A module buffer (`named_buffers()`, e.g. `router.expert_bias`), not a parameter."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class RankLayout:
    rank: int
    """Rank within this side (0 .. world-1); targets count across replicas."""
    replica: int
    """Which copy of the weights this rank belongs to (target replica; source DP index)."""
    tensors: tuple[PhysicalTensor, ...]
    """Physical tensors in `named_parameters()` order, then the buffers that must move."""


@dataclass(frozen=True, slots=True)
class Layout:
    side: Literal["source", "target"]
    """Which end of the transfer."""
    framework: str
    """megatron, fsdp2, vllm or sglang."""
    ranks: tuple[RankLayout, ...]
    """Every rank of this side, in rank order."""
    replicas: int
    """Number of full copies of the weights on this side (targets: engine replicas)."""

    @property
    def world(self) -> int:
        return len(self.ranks)
