"""Pass 4 (`route`): which target pieces take the direct path, which the gather path.

The direct path (`intersect` -> `assign` -> `lower`) writes every chunk of a target box
from the source replica `assign` picks. Two kinds of target box take `gather` instead:
- block-FP8 weights (`target.dtype: fp8_block128`, a weight whose `_scale_inv` is in the
  spec): a 128x128 block is quantized by one rank that holds all of it; their scale pieces
  are written by that gather too, so they take neither path on their own;
- fine-cut boxes: a box cut into `c` source chunks and held by `h` target ranks takes
  `c * h` writes directly and `c + h` gathered; it is gathered when the writes saved cost
  more than one more hop of the box (FSDP2 row shards of a tensor every target rank
  holds: 256 x 128 writes become 256 + 128), it lands as rows on both sides and the
  owner's staging can hold it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.fp8 import FP8, SCALE_SUFFIX
from planner.passes.intersect import (
    Boxes,
    PieceTable,
    boxes,
    element_size,
    intersect,
    keep_boxes,
    take,
)
from planner.spec import ModelSpec
from planner.topology import Topology
from schemas.config import Options
from schemas.plan import DTYPE_CODES


@dataclass(frozen=True, slots=True)
class Routes:
    """The target pieces, split by the path each takes."""

    targets: PieceTable
    """Every target piece (plan ranks)."""
    direct: PieceTable
    """The target pieces written directly (rows of `targets`, in order)."""
    gathered: np.ndarray
    """Rows of `targets` gathered onto one source first (FP8 weights, fine-cut boxes)."""
    scales: np.ndarray
    """Rows of `targets` holding FP8 block scales (written by the gather of their weight)."""
    direct_boxes: Boxes | None = None
    """`intersect.boxes(direct)`, for `intersect` (found here anyway)."""


def route(spec: ModelSpec, src: PieceTable, dst: PieceTable, opts: Options,
          topo: Topology, dst_boxes: Boxes | None = None) -> Routes:
    """Split the target pieces `dst` into the direct and the gathered path. `dst_boxes`:
    `intersect.boxes(dst)`, when known (`intersect.table_and_boxes`)."""
    names = [t.name for t in spec.tensors]
    fp8, scales = (_rows_of(dst.tensor, [i for i, n in enumerate(names) if pick(n)])
                   for pick in (lambda n: spec.by_name.get(n + SCALE_SUFFIX),
                                lambda n: n.endswith(SCALE_SUFFIX)))
    fp8 &= dst.dtype == DTYPE_CODES.index(FP8)
    other = fp8 | scales
    plain = None if not other.any() else np.flatnonzero(~other)  # None: every row
    del other
    if plain is None:  # all plain: no copy
        table, found = dst, boxes(dst) if dst_boxes is None else dst_boxes
    else:
        table = take(dst, plain)
        found = boxes(table)
    fine = fine_cut(spec, src, table, opts, topo, found)
    if len(fine):
        keep = np.ones(len(table), dtype=bool)
        keep[fine] = False  # whole boxes
        table, found = take(table, np.nonzero(keep)[0]), keep_boxes(found, keep)
    gathered = np.sort(np.concatenate([np.flatnonzero(fp8), fine if plain is None else
                                       plain[fine]]))
    return Routes(targets=dst, direct=table, gathered=gathered, scales=np.nonzero(scales)[0],
                  direct_boxes=found)


def _rows_of(tensor: np.ndarray, ids: list[int]) -> np.ndarray:
    """Whether each row's tensor is one of `ids` (`np.isin`; no pass over the rows when
    `ids` is empty)."""
    return np.isin(tensor, ids) if ids else np.zeros(len(tensor), dtype=bool)


def fine_cut(spec: ModelSpec, src: PieceTable, dst: PieceTable, opts: Options,
             topo: Topology, found: Boxes | None = None) -> np.ndarray:
    """Rows of `dst` whose box is worth gathering on one source first: a box cut into `c`
    source chunks and held by `h` target ranks takes `c * h` writes directly and `c + h`
    gathered; gather when the writes saved cost more than one more hop of the box.
    `found`: `intersect.boxes(dst)`, when known."""
    if len(dst) == 0:
        return np.zeros(0, dtype=np.int64)
    found = boxes(dst) if found is None else found
    first, inv = found.first, found.of
    holders = np.bincount(inv)
    # the distinct boxes, each once, in sorted order: their own boxes (no sort)
    each = np.arange(len(first))
    ch = intersect(spec, src, take(dst, first), Boxes(of=each, first=each))
    chunks = np.bincount(ch.dst, minlength=len(first))
    numel = dst.size0[first] * dst.size1[first]
    nbytes = numel * element_size(dst.dtype[first])
    saved_us = (chunks * holders - chunks - holders) * opts.write_overhead_us
    hop_us = nbytes * 8e-3 / topo.nic_gbps
    # Staging the owner needs: the gathered box (source dtype), and its cast (target dtype).
    one = ch.holders[ch.holder_ptr[ch.sbox[np.searchsorted(ch.dst, np.arange(len(first)))]]] \
        if len(ch) else np.zeros(len(first), dtype=np.int64)
    es_src = element_size(src.dtype[one]) if len(src) else np.ones(len(first), np.int64)
    cast = src.dtype[one] != dst.dtype[first] if len(src) else np.zeros(len(first), bool)
    need = numel * es_src + np.where(cast, nbytes, 0)
    fine = (chunks >= 2) & (holders >= 2) & (saved_us > hop_us)
    # A gather moves rows: boxes stored transposed (on either side) stay on the direct path.
    transposed = np.zeros(len(spec.tensors), dtype=bool)
    transposed[src.tensor[(src.a1 != 1) & (src.size1 > 1)]] = True
    transposed[dst.tensor[(dst.a1 != 1) & (dst.size1 > 1)]] = True
    fine &= ~transposed[dst.tensor[first]]
    fine &= need + 256 <= opts.staging_bytes - opts.staging_bytes // 4
    if not fine.any():  # (no pass over the rows)
        return np.zeros(0, dtype=np.int64)
    return np.nonzero(fine[inv])[0]


def gathered_only(routes: Routes) -> Routes:
    """`routes` with `targets` cut to the rows `gather` reads (the gathered and the scale
    rows, in order; `gathered` and `scales` renumbered) and no direct pieces: what the
    compiler keeps once the direct path is lowered."""
    mask = np.zeros(len(routes.targets), dtype=bool)
    mask[routes.gathered] = True
    mask[routes.scales] = True
    keep = np.flatnonzero(mask)  # (as `np.union1d`: sorted, each once; no sort)
    new = np.cumsum(mask, dtype=np.int64)
    new -= 1  # each kept row's place among them
    del mask
    targets = routes.targets if len(keep) == len(routes.targets) else \
        take(routes.targets, keep)
    return Routes(targets=targets, direct=take(routes.direct, keep[:0]),
                  gathered=new[routes.gathered], scales=new[routes.scales])
