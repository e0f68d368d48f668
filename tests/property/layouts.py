"""Random hand-built layouts for the property suite, independent of the framework layouts.

A side's layout is drawn per logical tensor: a grid of row cuts x column cuts (1-d
tensors: row cuts only) gives the boxes of one replica; each box goes to one rank, and
with some probability to a second rank too (replicated boxes, like TP-replicated norms
or GQA kv heads). Sources partition every tensor exactly (the planner requires it);
target boxes may also be replicated. Every replica repeats the same boxes.

Each rank then packs its boxes into physical tensors, in a random order and style:
- `plain`: alone, with 0-2 padding rows/columns before and after;
- `transposed`: a 2-d box stored `[cols, rows]` (`dims=(1, 0)`);
- `fused`: 2-d boxes of equal width concatenated along rows (`qkv_proj`, `gate_up`);
- `stacked`: 2-d boxes of equal shape stacked on a leading dim (`w13_weight [E, r, c]`);
- `column`: a 1-d box as column `j` of a `[n, w]` tensor (every element strided).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.spec import LogicalTensor, ModelSpec


@dataclass(frozen=True, slots=True)
class Box:
    tensor: LogicalTensor
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def cuts(draw: st.DrawFn, n: int, max_parts: int) -> list[tuple[int, int]]:
    """`[lo, hi)` ranges that split `n` into 1..max_parts non-empty parts, uneven."""
    parts = draw(st.integers(1, max(1, min(max_parts, n))))
    inner = sorted(draw(st.sets(st.integers(1, n - 1), min_size=parts - 1,
                                max_size=parts - 1))) if parts > 1 else []
    bounds = [0, *inner, n]
    return list(zip(bounds[:-1], bounds[1:]))


def _boxes(draw: st.DrawFn, t: LogicalTensor, max_parts: int) -> list[Box]:
    rows = cuts(draw, t.shape[0], max_parts)
    if len(t.shape) == 1:
        return [Box(t, (lo,), (hi - lo,)) for lo, hi in rows]
    cols = cuts(draw, t.shape[1], max(1, max_parts // 2))
    return [Box(t, (r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in rows for c0, c1 in cols]


def _dtype(t: LogicalTensor, dtype: str) -> str:
    return t.dtype if t.buffer else dtype


def _physical(draw: st.DrawFn, boxes: list[Box], dtype: str, name: str
              ) -> tuple[PhysicalTensor, int]:
    """One physical tensor from the first box(es) of `boxes`; returns it and how many it used."""
    b = boxes[0]
    pdt = _dtype(b.tensor, dtype)
    same_dtype = [x for x in boxes if _dtype(x.tensor, dtype) == pdt]
    if len(b.sizes) == 1:
        style = draw(st.sampled_from(["plain", "column"]))
        n = b.sizes[0]
        if style == "column":
            w, j = draw(st.integers(1, 3)), draw(st.integers(0, 2))
            w = max(w, j + 1)
            return PhysicalTensor(name, (n, w), pdt,
                                  (Piece(b.tensor.name, b.offsets, b.sizes, (0, j), (0,)),)), 1
        pad0, pad1 = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        return PhysicalTensor(name, (pad0 + n + pad1,), pdt,
                              (Piece(b.tensor.name, b.offsets, b.sizes, (pad0,)),)), 1
    r, c = b.sizes
    style = draw(st.sampled_from(["plain", "fused", "stacked", "transposed"]))
    if style == "transposed":
        return PhysicalTensor(name, (c, r), pdt,
                              (Piece(b.tensor.name, b.offsets, b.sizes, (0, 0), (1, 0)),)), 1
    if style == "fused":
        group = [x for x in same_dtype if len(x.sizes) == 2 and x.sizes[1] == c][:3]
        group = group[: draw(st.integers(1, len(group)))] if b in group else [b]
        pieces, row = [], 0
        for x in group:
            row += draw(st.integers(0, 1))  # a padding row between fused tensors
            pieces.append(Piece(x.tensor.name, x.offsets, x.sizes, (row, 0)))
            row += x.sizes[0]
        return PhysicalTensor(name, (row, c), pdt, tuple(pieces)), len(group)
    if style == "stacked":
        group = [x for x in same_dtype if x.sizes == b.sizes][:3]
        group = group[: draw(st.integers(1, len(group)))] if b in group else [b]
        k = len(group) + draw(st.integers(0, 1))  # an empty slot: padding
        pieces = tuple(Piece(x.tensor.name, x.offsets, x.sizes, (i, 0, 0))
                       for i, x in enumerate(group))
        return PhysicalTensor(name, (k, r, c), pdt, pieces), len(group)
    pad = [draw(st.integers(0, 2)) for _ in range(4)]
    return PhysicalTensor(name, (pad[0] + r + pad[1], pad[2] + c + pad[3]), pdt,
                          (Piece(b.tensor.name, b.offsets, b.sizes, (pad[0], pad[2])),)), 1


def _rank_tensors(draw: st.DrawFn, boxes: list[Box], dtype: str
                  ) -> tuple[PhysicalTensor, ...]:
    order = draw(st.permutations(range(len(boxes)))) if len(boxes) > 1 else list(range(
        len(boxes)))
    left = [boxes[i] for i in order]
    out = []
    while left:
        pt, used_n = _physical(draw, left, dtype, f"p{len(out)}")
        used = {p.tensor + repr(p.offsets) for p in pt.pieces}
        out.append(pt)
        left = [x for x in left if x.tensor.name + repr(x.offsets) not in used]
        assert used_n == len(pt.pieces)
    return tuple(out)


@st.composite
def random_layout(draw: st.DrawFn, spec: ModelSpec, side: str, per_replica: int,
                  replicas: int, dtype: str, max_parts: int = 4) -> Layout:
    """A random layout of `spec`: `per_replica` ranks per replica, `replicas` copies."""
    held: list[list[Box]] = [[] for _ in range(per_replica)]
    for t in spec.tensors:
        for b in _boxes(draw, t, max_parts):
            first = draw(st.integers(0, per_replica - 1))
            held[first].append(b)
            if per_replica > 1 and draw(st.integers(0, 4)) == 0:  # a replicated box
                second = draw(st.integers(0, per_replica - 1))
                if second != first:
                    held[second].append(b)
    tensors = [_rank_tensors(draw, boxes, dtype) for boxes in held]
    ranks = tuple(RankLayout(rep * per_replica + r, rep, tensors[r])
                  for rep in range(replicas) for r in range(per_replica))
    return Layout(side, "synthetic", ranks, replicas)  # type: ignore[arg-type]
