"""Small geometry helpers shared by the source layouts: row/column boxes and even cuts.

A "segment list" describes a fused tensor whose rows are the concatenation of row ranges
of several logical tensors (Megatron `linear_qkv`: per group `[q rows; k rows; v rows]`).
`cut_rows` returns the pieces that fall into one rank's contiguous row range of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.layouts.base import PhysicalTensor, Piece
from schemas.config import ConfigError

Segment = tuple[str, int, int]
"""(logical tensor, first logical row, number of rows)."""


def box(tensor: str, shape: Sequence[int], dim: int, start: int, stop: int,
        at: int = 0, lead: int = 0) -> Piece:
    """Logical elements `[start, stop)` along `dim` (all of the other dims), placed at
    physical offset `at` along the same dim; `lead` extra leading physical dims at 0."""
    offsets = [0] * len(shape)
    sizes = list(shape)
    offsets[dim] = start
    sizes[dim] = stop - start
    pos = [0] * (lead + len(shape))
    pos[lead + dim] = at
    return Piece(tensor, tuple(offsets), tuple(sizes), tuple(pos))


def whole(tensor: str, shape: Sequence[int]) -> Piece:
    return Piece(tensor, (0,) * len(shape), tuple(shape), (0,) * len(shape))


def physical(name: str, shape: Sequence[int], dtype: str,
             pieces: Sequence[Piece]) -> PhysicalTensor:
    """A physical tensor; pieces with an empty box are dropped."""
    return PhysicalTensor(name, tuple(shape), dtype,
                          tuple(p for p in pieces if all(s > 0 for s in p.sizes)))


def cut_rows(segments: Sequence[Segment], rest: Sequence[int], start: int,
             stop: int) -> list[Piece]:
    """Pieces of the rows `[start, stop)` of the concatenation of `segments`.

    `rest` is the shape of the trailing dims (columns); the pieces land at physical row
    `row - start`.
    """
    pieces = []
    base = 0
    for tensor, first, n in segments:
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            pieces.append(Piece(tensor, (first + lo - base, *(0 for _ in rest)),
                                (hi - lo, *rest), (lo - start, *(0 for _ in rest))))
        base += n
    return pieces


def even(n: int, parts: int, index: int, key: str, value: int, what: str) -> tuple[int, int]:
    """`[index*n/parts, (index+1)*n/parts)`; a ConfigError naming `key` if uneven."""
    if n % parts:
        raise ConfigError(f"{key}: {value!r} does not divide {what}={n}; use a divisor of {n}")
    per = n // parts
    return index * per, (index + 1) * per


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """The `torch.chunk` rule: chunk `c=ceil(n/parts)`, index i holds `[i*c, (i+1)*c)`
    clipped to n (trailing chunks may be empty)."""
    c = -(-n // parts)
    lo = min(index * c, n)
    return lo, min(lo + c, n)
