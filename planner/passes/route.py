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
    Chunks,
    PieceTable,
    Repeated,
    boxes,
    element_size,
    join,
    keep_boxes,
    keep_pairs,
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
    direct_pairs: Chunks | None = None
    """`intersect.join` of `direct` and the source, for `intersect` (made here anyway, by
    `fine_cut`); None where not made."""


def route(spec: ModelSpec, src: PieceTable, dst: PieceTable, opts: Options,
          topo: Topology, dst_boxes: Boxes | None = None) -> Routes:
    """Split the target pieces `dst` into the direct and the gathered path. `dst_boxes`:
    `intersect.boxes(dst)`, when known (`intersect.table_and_boxes`)."""
    names = [t.name for t in spec.tensors]
    fp8_ids, scale_ids = ([i for i, n in enumerate(names) if pick(n)]
                          for pick in (lambda n: spec.by_name.get(n + SCALE_SUFFIX),
                                       lambda n: n.endswith(SCALE_SUFFIX)))
    plain = plain_one = None  # None: every row (of every copy; of the first copy)
    fp8 = scales = np.zeros(0, dtype=np.intp)  # rows
    if fp8_ids or scale_ids:  # (else no pass over the rows)
        tensor, dtype = _one_copy(dst.tensor, dst.dtype)  # (the same in every copy)
        is_fp8, is_scale = _rows_of(tensor, fp8_ids), _rows_of(tensor, scale_ids)
        is_fp8 &= dtype == DTYPE_CODES.index(FP8)
        if (is_fp8 | is_scale).any():
            plain_one = np.flatnonzero(~(is_fp8 | is_scale))
        if len(tensor) < len(dst):
            is_fp8, is_scale = (np.tile(m, len(dst) // len(tensor))
                                for m in (is_fp8, is_scale))
        else:
            plain_one = None  # (one copy: the whole table)
        other = is_fp8 | is_scale
        plain = None if not other.any() else np.flatnonzero(~other)
        fp8, scales = np.flatnonzero(is_fp8), np.flatnonzero(is_scale)
        del other, is_fp8, is_scale
    if plain is None:  # all plain: no copy
        table, found = dst, boxes(dst) if dst_boxes is None else dst_boxes
    elif plain_one is not None and _repeated(dst):  # each copy's plain rows, held once
        table = PieceTable(*(_kept(getattr(dst, f), plain_one)
                             for f in PieceTable.__slots__))
        one = boxes(PieceTable(*(getattr(table, f).one for f in PieceTable.__slots__)))
        found = Boxes(of=Repeated(one.of, table.rank.times), first=one.first)
    else:
        table = take(dst, plain)
        found = boxes(table)
    fine, pairs = _fine_cut(spec, src, table, opts, topo, found)
    if len(fine):
        keep = np.ones(len(table), dtype=bool)
        keep[fine] = False  # whole boxes
        if pairs is not None:
            pairs = keep_pairs(pairs, keep[found.first])
        table, found = take(table, np.nonzero(keep)[0]), keep_boxes(found, keep)
    gathered = np.sort(np.concatenate([fp8, fine if plain is None else plain[fine]]))
    return Routes(targets=dst, direct=table, gathered=gathered, scales=scales,
                  direct_boxes=found, direct_pairs=pairs)


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
    return _fine_cut(spec, src, dst, opts, topo, found)[0]


def _fine_cut(spec: ModelSpec, src: PieceTable, dst: PieceTable, opts: Options,
              topo: Topology, found: Boxes | None = None
              ) -> tuple[np.ndarray, Chunks | None]:
    """`fine_cut`, and the `intersect.join` of `dst`'s boxes (`found`) it makes (None
    where there are no rows)."""
    if len(dst) == 0:
        return np.zeros(0, dtype=np.int64), None
    found = boxes(dst) if found is None else found
    first, inv = found.first, found.of
    one = _one_copy(inv)[0]
    holders = np.bincount(one, minlength=len(first))
    if one is not inv:
        holders *= inv.times  # (each copy's rows hold the same boxes: `Repeated`)
    ch = join(spec, src, dst, found)  # the distinct boxes' chunks: `dst` their box
    chunks = np.bincount(ch.dst, minlength=len(first))
    numel = dst.size0[first] * dst.size1[first]
    nbytes = numel * element_size(dst.dtype[first])
    saved_us = (chunks * holders - chunks - holders) * opts.write_overhead_us
    hop_us = nbytes * 8e-3 / topo.nic_gbps
    # Staging the owner needs: the gathered box (source dtype), and its cast (target dtype).
    # (each box's first chunk: `ch.dst` is sorted and every box has one, coverage checked)
    one = ch.holders[ch.holder_ptr[ch.sbox[np.cumsum(chunks) - chunks]]] \
        if len(ch) else np.zeros(len(first), dtype=np.int64)
    es_src = element_size(src.dtype[one]) if len(src) else np.ones(len(first), np.int64)
    cast = src.dtype[one] != dst.dtype[first] if len(src) else np.zeros(len(first), bool)
    need = numel * es_src + np.where(cast, nbytes, 0)
    fine = (chunks >= 2) & (holders >= 2) & (saved_us > hop_us)
    # A gather moves rows: boxes stored transposed (on either side) stay on the direct path.
    transposed = np.zeros(len(spec.tensors), dtype=bool)
    for t in (src, dst):
        tensor, a1, size1 = _one_copy(t.tensor, t.a1, t.size1)
        transposed[tensor[(a1 != 1) & (size1 > 1)]] = True
    fine &= ~transposed[dst.tensor[first]]
    fine &= need + 256 <= opts.staging_bytes - opts.staging_bytes // 4
    if not fine.any():  # (no pass over the rows)
        return np.zeros(0, dtype=np.int64), ch
    if isinstance(inv, Repeated) and not inv.step:  # each copy's rows, moved: in order
        one = np.nonzero(fine[inv.one])[0]
        return (one + (np.arange(inv.times) * len(inv.one))[:, None]).reshape(-1), ch
    return np.nonzero(fine[inv])[0], ch


def _repeated(t: PieceTable) -> bool:
    """Whether every column of `t` is a `Repeated` of as many copies."""
    times = getattr(t.rank, "times", 0)
    return all(isinstance(getattr(t, f), Repeated) and getattr(t, f).times == times
               for f in PieceTable.__slots__)


def _kept(col: Repeated, rows: np.ndarray) -> Repeated:
    """The rows `rows` of each copy of `col`, as a `Repeated` of as many copies (the rows
    of `take` of every copy's `rows`)."""
    one = col.one[rows]
    one.flags.writeable = False
    return Repeated(one, col.times, col.step)


def _one_copy(*cols: np.ndarray) -> tuple[np.ndarray, ...]:
    """`cols`, or where each is a `Repeated` of the same copies, each the same
    (`step` 0), their first copy: the same rows, each as many times less."""
    if all(isinstance(c, Repeated) and not c.step and c.times == cols[0].times
           for c in cols):
        return tuple(c.one for c in cols)  # type: ignore[attr-defined]
    return cols


def gathered_only(routes: Routes) -> Routes:
    """`routes` with `targets` cut to the rows `gather` reads (the gathered and the scale
    rows, in order; `gathered` and `scales` renumbered) and no direct pieces: what the
    compiler keeps once the direct path is lowered."""
    if len(routes.gathered) or len(routes.scales):
        mask = np.zeros(len(routes.targets), dtype=bool)
        mask[routes.gathered] = True
        mask[routes.scales] = True
        keep = np.flatnonzero(mask)  # (as `np.union1d`: sorted, each once; no sort)
        del mask
    else:  # (no pass over the rows)
        keep = np.zeros(0, dtype=np.intp)
    targets = routes.targets if len(keep) == len(routes.targets) else \
        take(routes.targets, keep)
    # each kept row's place among them (by search: no column as long as the targets)
    return Routes(targets=targets, direct=take(routes.direct, keep[:0]),
                  gathered=np.searchsorted(keep, routes.gathered),
                  scales=np.searchsorted(keep, routes.scales))
