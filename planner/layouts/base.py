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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


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


@dataclass(frozen=True, slots=True)
class PhysicalTensor:
    name: str
    """Native name, as `named_parameters()` (or `named_buffers()`) gives it on that rank."""
    shape: tuple[int, ...]
    """Local shape on that rank."""
    dtype: str
    """Local dtype (`bfloat16`, `float32`, ...)."""
    pieces: tuple[Piece, ...]
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
