"""Pass 3 (`intersect`): target pieces x source pieces over the same logical boxes.

Every piece becomes a row of columnar arrays (`PieceTable`): its logical box, and the
affine map from logical index to element offset in its physical tensor:
`offset(i0, i1) = base + i0 * a0 + i1 * a1` (1-d logical tensors are `[n, 1]`).

Source pieces with equal boxes are replicas of one *source box*; a target piece is cut
by the source boxes it overlaps into *chunks*. Each chunk keeps its candidate holders
(the replicas of its source box) for `assign` to choose from. Work is vectorised: the
join runs per logical tensor over unique boxes only, never per byte range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.layouts.base import Layout
from planner.rows import unique_rows
from planner.spec import ModelSpec
from schemas.plan import DTYPE_CODES
from schemas.protocol import ITEM


@dataclass(frozen=True, slots=True)
class PieceTable:
    """One side's pieces as columns; `rank` is the plan rank."""

    rank: np.ndarray
    region: np.ndarray
    tensor: np.ndarray
    off0: np.ndarray
    off1: np.ndarray
    size0: np.ndarray
    size1: np.ndarray
    base: np.ndarray
    a0: np.ndarray
    a1: np.ndarray
    dtype: np.ndarray
    """dtype code (`schemas.plan.DTYPE_CODES`) of the physical tensor."""

    def __len__(self) -> int:
        return len(self.rank)


@dataclass(frozen=True, slots=True)
class Chunks:
    """Target boxes, each fed by one source box (several candidate holders)."""

    tensor: np.ndarray
    off0: np.ndarray
    off1: np.ndarray
    size0: np.ndarray
    size1: np.ndarray
    dst: np.ndarray
    """Row of the target piece in the target `PieceTable`."""
    sbox: np.ndarray
    """Source box id; its holders are `holders[holder_ptr[sbox]:holder_ptr[sbox + 1]]`."""
    holder_ptr: np.ndarray
    holders: np.ndarray
    """Rows of the source `PieceTable`, grouped by source box."""

    def __len__(self) -> int:
        return len(self.tensor)


def take(t: PieceTable, rows: np.ndarray) -> PieceTable:
    """The rows `rows` of a piece table, as a new table."""
    return PieceTable(*(getattr(t, f)[rows] for f in PieceTable.__slots__))


def chunk_bytes(chunks: Chunks, dst: PieceTable) -> np.ndarray:
    """Bytes of each chunk in the target's dtype."""
    return chunks.size0 * chunks.size1 * element_size(dst.dtype[chunks.dst])


def piece_table(layout: Layout, spec: ModelSpec, rank_base: int) -> PieceTable:
    """Flatten a layout's pieces into columns (plan rank = rank_base + layout rank)."""
    tensor_id = {t.name: i for i, t in enumerate(spec.tensors)}
    cache: dict[int, list[tuple[int, ...]]] = {}  # id(physical tensor) -> its rows
    ranks: dict[int, np.ndarray] = {}  # id(a rank's tensors) -> (region, *row) rows
    blocks = []
    for rl in layout.ranks:
        block = ranks.get(id(rl.tensors))  # replicas share their engine rank's tuple
        if block is None:
            rows: list[tuple[int, ...]] = []
            for region, pt in enumerate(rl.tensors):
                if id(pt) not in cache:
                    cache[id(pt)] = _tensor_rows(pt, tensor_id)
                rows.extend((region, *row) for row in cache[id(pt)])
            block = ranks[id(rl.tensors)] = np.array(rows, dtype=np.int64).reshape(-1, 10)
        blocks.append(np.concatenate([np.full((len(block), 1), rank_base + rl.rank,
                                              dtype=np.int64), block], axis=1))
    cols = (np.concatenate(blocks) if blocks else np.zeros((0, 11), dtype=np.int64)).T
    return PieceTable(*cols)


def _tensor_rows(pt, tensor_id: dict[str, int]) -> list[tuple[int, ...]]:
    strides = [math.prod(pt.shape[d + 1:]) for d in range(len(pt.shape))]
    code = DTYPE_CODES.index(pt.dtype)
    rows = []
    for p in pt.pieces:
        if p.tensor not in tensor_id:
            raise ValueError(f"layout: {pt.name} holds a piece of {p.tensor!r}, which is not "
                             "in the model spec")
        dims = p.phys_dims()
        a = [strides[d] for d in dims] + [1] * (2 - len(dims))
        off = list(p.offsets) + [0] * (2 - len(p.offsets))
        size = list(p.sizes) + [1] * (2 - len(p.sizes))
        base = sum(x * s for x, s in zip(p.at, strides)) - off[0] * a[0] - off[1] * a[1]
        rows.append((tensor_id[p.tensor], off[0], off[1], size[0], size[1], base, a[0],
                     a[1], code))
    return rows


def _unique_boxes(t: PieceTable) -> tuple[np.ndarray, np.ndarray]:
    """(box id of each row, row index of each unique box's first holder); boxes sorted by
    (tensor, off0, off1, size0, size1)."""
    keys = np.stack([t.tensor, t.off0, t.off1, t.size0, t.size1], axis=1)
    uniq, inverse = unique_rows(keys, return_inverse=True)
    return inverse.reshape(-1), uniq


def intersect(spec: ModelSpec, src: PieceTable, dst: PieceTable) -> Chunks:
    """Cut every target piece by the source boxes it overlaps; check exact coverage."""
    sbox_of, sboxes = _unique_boxes(src)
    tbox_of, tboxes = _unique_boxes(dst)
    # Cross join unique target boxes with the unique source boxes of the same tensor.
    s_start = np.searchsorted(sboxes[:, 0], tboxes[:, 0], side="left")
    s_end = np.searchsorted(sboxes[:, 0], tboxes[:, 0], side="right")
    counts = s_end - s_start
    tb = np.repeat(np.arange(len(tboxes)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    sb = np.repeat(s_start, counts) + (np.arange(len(tb)) - first)
    lo0 = np.maximum(tboxes[tb, 1], sboxes[sb, 1])
    lo1 = np.maximum(tboxes[tb, 2], sboxes[sb, 2])
    hi0 = np.minimum(tboxes[tb, 1] + tboxes[tb, 3], sboxes[sb, 1] + sboxes[sb, 3])
    hi1 = np.minimum(tboxes[tb, 2] + tboxes[tb, 4], sboxes[sb, 2] + sboxes[sb, 4])
    keep = (hi0 > lo0) & (hi1 > lo1)
    tb, sb, lo0, lo1, hi0, hi1 = (x[keep] for x in (tb, sb, lo0, lo1, hi0, hi1))
    _check_coverage(spec, tboxes, tb, (hi0 - lo0) * (hi1 - lo1), dst, tbox_of)
    # Expand box pairs (grouped by tbox, as `tb` is sorted) to every target piece row.
    pair_ptr = np.searchsorted(tb, np.arange(len(tboxes) + 1))
    per_row = pair_ptr[tbox_of + 1] - pair_ptr[tbox_of]
    rows = np.repeat(np.arange(len(dst)), per_row)
    first = np.repeat(np.cumsum(per_row) - per_row, per_row)
    pair = np.repeat(pair_ptr[tbox_of], per_row) + (np.arange(len(rows)) - first)
    holders = np.argsort(sbox_of, kind="stable")
    holder_ptr = np.searchsorted(sbox_of[holders], np.arange(len(sboxes) + 1))
    return Chunks(tensor=tboxes[tb[pair], 0], off0=lo0[pair], off1=lo1[pair],
                  size0=(hi0 - lo0)[pair], size1=(hi1 - lo1)[pair], dst=rows, sbox=sb[pair],
                  holder_ptr=holder_ptr, holders=holders)


def _check_coverage(spec: ModelSpec, tboxes: np.ndarray, tb: np.ndarray, numel: np.ndarray,
                    dst: PieceTable, tbox_of: np.ndarray) -> None:
    covered = np.bincount(tb, weights=numel.astype(np.float64), minlength=len(tboxes))
    want = (tboxes[:, 3] * tboxes[:, 4]).astype(np.float64)
    bad = np.nonzero(covered != want)[0]
    if len(bad):
        b = tboxes[bad[0]]
        row = int(np.nonzero(tbox_of == bad[0])[0][0])
        name = spec.tensors[b[0]].name
        what = "covers only" if covered[bad[0]] < want[bad[0]] else "covers overlapping"
        raise ValueError(
            f"intersect: the source layout {what} {int(covered[bad[0]])} of "
            f"{int(want[bad[0]])} elements of {name} box offsets=({b[1]}, {b[2]}) "
            f"sizes=({b[3]}, {b[4]}) that target rank {int(dst.rank[row])} needs; the "
            "source and target configs must describe the same model (and source replicas "
            "must shard each tensor the same way)")


def element_size(code: np.ndarray) -> np.ndarray:
    return ITEM[code]
