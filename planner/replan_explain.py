"""The replan's explain rows (`planner/replan.py`): the rows of the experts whose count of
slots in some stacked expert tensor changes, made again from what one slot of each
(stacked tensor, source rank, weight) is fed, put in the table in its order.

What one slot is fed (`Feeds`) is read lazily: the rows of an expert tensor are read (and
checked) the first time a replan makes them again, and they give what one slot of each
stacked tensor holding it is fed, with the checks that make the rows of those experts a
product of it (each expert of a stacked tensor fed by the same source ranks, each the same
bytes and boxes per slot it holds, the slot fed whole). A stacked tensor that takes a new
expert gives up a slot of an expert whose rows are made again, so what it is fed is always
read. `Feeds` is kept for the table the replan makes (which never changes it), with where
each tensor's rows start: the next replan reads only the rows of experts not read before.
An expert's rows are then its source ranks, in order, each once per stacked tensor holding
it, in (target rank, region) order (the table's sort)."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import numpy as np

from planner.errors import NotIncremental
from planner.placement import ExpertIds
from planner.replan_tables import Hits, Slots, SourceTensors
from planner.rows import lexorder
from schemas.placement import Placement
from schemas.plan import EXPLAIN_COLUMNS
from schemas.table import Table


@dataclasses.dataclass(frozen=True)
class Feeds:
    """What one slot of each stacked expert tensor `k` (`every`'s order) is fed by each
    source rank `s` for each weight `w`, at `(k * sources + s) * weights + w`: bytes and
    boxes (-1: none, or not read yet), filled in place as the rows of expert tensors are
    read (only once checked)."""

    every: Hits
    """Every stacked expert tensor of the plan (`slot_regions`), as columns."""
    slot_tensor: np.ndarray
    """The stacked tensor of each physical slot of every tensor, in `every`'s order ..."""
    slot_at: np.ndarray
    """... and that slot's global index."""
    per_bytes: np.ndarray
    per_boxes: np.ndarray
    present: np.ndarray
    """(tensor, source rank, weight): whether that source feeds that weight."""
    known: np.ndarray
    """Per stacked tensor: whether what it is fed has been read."""
    read: np.ndarray
    """Per spec tensor: whether its rows have been read (and checked)."""
    other: np.ndarray
    """Per spec tensor read: whether some of its rows go into other tensors than the
    stacked ones."""


_KEPT: list[tuple[weakref.ref, list[Slots], ExpertIds, Feeds, np.ndarray]] = []
"""The last few explain tables read or made by a replan, by the identity of their
`dst_region` column (new in every table a replan changes; weakly held, so a table is not
kept alive by it), the plan's stacked tensors and the spec's ids: its `Feeds` and where
each tensor's rows start. Most recently used last."""


def explain(table: Table, slots: list[Slots], old: Placement, new: Placement,
            src: SourceTensors, ids: ExpertIds, sources: int) -> Table:
    """The explain table with the rows of every expert whose count of slots in some stacked
    tensor (`slots`: every one of the plan) changes from `old` to `new` made again; the
    other rows stay as they are."""
    if not len(table):
        return table
    feeds, starts = _kept(table, slots, ids, sources)
    every = feeds.every
    before, after = (_counts(every, feeds.slot_tensor, feeds.slot_at, p, ids)
                     for p in (old, new))
    kx, ex = np.nonzero(before != after)
    changed = np.zeros(ids.ids.shape[:2], bool)  # (MoE layer, expert) whose rows change
    changed[every.moe[kx], ex] = True
    affected = ids.ids[changed].reshape(-1)
    affected = np.sort(affected[affected >= 0])
    if not len(affected):
        return table
    region = _regions(src, affected, sources)
    _read(table, feeds, starts, affected, region, before, ids, sources)
    hold = after * changed[every.moe]
    need = np.flatnonzero(hold.any(1))  # the stacked tensors the rows made go into
    if not feeds.known[need].all():
        raise NotIncremental("replan: a stacked expert tensor is fed by none of its experts' "
                             "explain rows; the plan is corrupt: recompile it")
    srcs, n_src, other = _shape(feeds, need, affected)
    cols, lengths = _rows(feeds, srcs, n_src, region, hold, affected, ids, sources)
    regular = srcs is not None
    if other:  # the affected tensors' rows into other tensors: kept, merged in
        cols, lengths = _merged(table, feeds, starts, affected, cols)
        regular = False
    out = _spliced(table, starts, affected, lengths, cols, regular)
    counts = np.diff(starts)
    counts[affected] = lengths
    _keep(out, slots, ids, feeds, np.concatenate([[0], np.cumsum(counts)]))
    return out


def _kept(table: Table, slots: list[Slots], ids: ExpertIds,
          sources: int) -> tuple[Feeds, np.ndarray]:
    key = table["dst_region"]
    for i, (kept, kept_slots, kept_ids, feeds, starts) in enumerate(_KEPT):
        if kept() is key and kept_slots is slots and kept_ids is ids:
            _KEPT.append(_KEPT.pop(i))
            return feeds, starts
    every = Hits(slots)
    kk = np.repeat(np.arange(len(slots)), every.count)
    at = every.first[kk] + np.arange(len(kk)) - np.repeat(np.cumsum(every.count)
                                                          - every.count, every.count)
    counts = np.bincount(table["tensor"], minlength=len(ids.layer))
    starts = np.concatenate([[0], np.cumsum(counts)])
    n_k, n_w, n_t = len(slots), ids.ids.shape[2], len(ids.layer)
    size = n_k * sources * n_w
    feeds = Feeds(every, kk, at, np.full(size, -1, np.int64), np.full(size, -1, np.int64),
                  np.zeros((n_k, sources, n_w), bool), np.zeros(n_k, bool),
                  np.zeros(n_t, bool), np.zeros(n_t, bool))
    _keep(table, slots, ids, feeds, starts)
    return feeds, starts


def _keep(table: Table, slots: list[Slots], ids: ExpertIds, feeds: Feeds,
          starts: np.ndarray) -> None:
    _KEPT[:] = [k for k in _KEPT if k[0]() is not None][-3:]
    _KEPT.append((weakref.ref(table["dst_region"]), slots, ids, feeds, starts))


def _counts(every: Hits, slot_tensor: np.ndarray, slot_at: np.ndarray, p: Placement,
            ids: ExpertIds) -> np.ndarray:
    """Slots of each expert (columns) in each stacked tensor (rows) under placement `p`
    (`slot_tensor`, `slot_at`: `Feeds`')."""
    n, e = len(every.key), ids.ids.shape[1]
    held = p.table[every.moe[slot_tensor], slot_at]
    return np.bincount(slot_tensor * e + held, minlength=n * e).reshape(n, e)


def _uneven() -> NotIncremental:
    return NotIncremental("replan: the slots of one target tensor are fed unevenly by its "
                          "experts; compile the new placement in full")


def _fed_other() -> NotIncremental:
    return NotIncremental("replan: a stacked expert tensor is fed other tensors; compile "
                          "the new placement in full")


def _unsorted() -> NotIncremental:
    return NotIncremental("replan: the explain table is not in tensor order; the plan is "
                          "corrupt: recompile it")


def _regions(src: SourceTensors, tensors: np.ndarray, sources: int) -> np.ndarray:
    """Source rank x `tensors[j]`: the region holding it on that rank (-1: none)."""
    out = np.empty((sources, len(tensors)), np.int32)
    for r in range(sources):
        out[r] = src.of(r)[tensors]
    return out


def _ranges(starts: np.ndarray, tensors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of `tensors` (sorted), tensor by tensor, and each one's number of rows."""
    lo, span = starts[tensors], starts[tensors + 1] - starts[tensors]
    return np.repeat(lo - np.cumsum(span) + span, span) + np.arange(int(span.sum())), span


def _read(table: Table, feeds: Feeds, starts: np.ndarray, affected: np.ndarray,
          region: np.ndarray, before: np.ndarray, ids: ExpertIds, sources: int) -> None:
    """`feeds` filled from the rows of the `affected` expert tensors not read before (the
    table's, for the counts `before`; `region`: `_regions` of `affected`), once they are
    checked: each row into a stacked
    tensor is one of its experts' (of that MoE layer), from a source rank, the source
    region the rank holds the expert in, and its bytes and boxes the same multiple of the
    expert's slots there for every expert of the tensor; every expert of a tensor is fed
    by the same source ranks; a slot is fed whole by them (so by no other tensor: a plan
    writes each byte once)."""
    every = feeds.every
    n_k, n_w = len(every.key), ids.ids.shape[2]
    fresh = affected[~feeds.read[affected]]
    if not len(fresh):
        return
    span = starts[fresh + 1] - starts[fresh]
    col = table["tensor"]
    if 2 * int(span.sum()) > len(col):  # most of the table: read whole
        if not (col[1:] >= col[:-1]).all():
            raise _unsorted()
        rows, k = every.find(table["dst_rank"], table["dst_region"])
        t = col[rows]
        mine = np.zeros(len(ids.layer), bool)
        mine[fresh] = True
        keep = mine[t]
        if not keep.all():  # (rows of tensors read before, or not affected)
            keep = np.flatnonzero(keep)
            rows, k, t = rows[keep], k[keep], t[keep]
    else:
        within, _ = _ranges(starts, fresh)
        t = col[within]
        if not np.array_equal(t, np.repeat(fresh, span)):
            raise _unsorted()
        sub, k = every.find(table["dst_rank"][within], table["dst_region"][within])
        rows, t = within[sub], t[sub]  # the rows into stacked tensors
    experts = ids.ids.shape[1]
    e = ids.packed[t]  # (MoE layer * experts + expert) << wbits | weight; -1: none
    w = e & ((1 << ids.wbits) - 1)
    e >>= ids.wbits
    e -= every.moe[k] * experts  # the expert, if of the stacked tensor's layer
    if len(e) and (int(e.min()) < 0 or int(e.max()) >= experts):
        raise _fed_other()
    at = np.zeros(len(ids.layer), np.int64)
    at[affected] = np.arange(len(affected))
    at_t = at[t]  # each row's tensor among `affected`
    other = np.bincount(at_t, minlength=len(affected))[at[fresh]] != span
    s = table["src_rank"][rows]
    if len(s) and (s.min() < 0 or s.max() >= sources):
        raise NotIncremental("replan: a stacked expert tensor is fed by a target rank "
                             "(copied or gathered there); compile the new placement in full")
    at_s = np.multiply(s, len(affected), dtype=np.int64)
    at_s += at_t
    if (region.reshape(-1)[at_s] != table["src_region"][rows]).any():
        raise NotIncremental("replan: a stacked expert tensor is fed from a source region "
                             "that does not hold the expert; compile the new placement in "
                             "full")
    del at_s, at_t
    at_n = np.multiply(k, experts, dtype=np.int64)
    at_n += e
    n = before.reshape(-1)[at_n]
    del at_n
    if (n == 0).any():
        raise NotIncremental("replan: a stacked expert tensor is fed an expert it does not "
                             "hold: the plan is corrupt: recompile it")
    nbytes, boxes = table["nbytes"][rows], table["boxes"][rows]  # (copies: divided below)
    key = k.astype(np.int64)
    key *= sources
    key += s
    key *= n_w
    key += w
    multi = np.flatnonzero(n != 1)  # rows of experts held in several slots: divided
    n_m, whole_b, whole_x = n[multi], nbytes[multi], boxes[multi]
    share_b, share_x = nbytes, boxes
    share_b[multi] = whole_b // n_m
    share_x[multi] = whole_x // n_m
    if (share_b[multi] * n_m != whole_b).any() or (share_x[multi] * n_m != whole_x).any():
        raise _uneven()
    pb, px = np.full(len(feeds.per_bytes), -1, np.int64), np.full(len(feeds.per_boxes), -1,
                                                                  np.int64)
    pb[key], px[key] = share_b, share_x
    if (pb[key] != share_b).any() or (px[key] != share_x).any():
        raise _uneven()  # one slot's share is not the same for every expert (or no share)
    mine = np.zeros(ids.ids.shape[:2], bool)
    mine[ids.layer[fresh], ids.expert[fresh]] = True  # the experts read here
    held = before * mine[every.moe]
    distinct = np.count_nonzero(held, axis=1)  # of them, those each tensor holds
    cnt = np.bincount(key, minlength=len(pb)).reshape(n_k, -1)  # rows per (source, weight)
    if (cnt % np.maximum(distinct, 1)[:, None]).any() or (cnt > distinct[:, None]).any():
        raise _uneven()  # some expert of a tensor not fed by a source that feeds the others
    present = cnt.reshape(n_k, sources, n_w) > 0
    seen = distinct > 0
    was = seen & feeds.known
    pb, px = pb.reshape(n_k, -1), px.reshape(n_k, -1)
    if (pb[was] != feeds.per_bytes.reshape(n_k, -1)[was]).any() or (
            px[was] != feeds.per_boxes.reshape(n_k, -1)[was]).any():
        raise _uneven()  # fed otherwise than its experts read before
    learnt = seen & ~feeds.known
    per_slot = np.where(present[learnt], pb[learnt].reshape(-1, sources, n_w), 0)
    if (per_slot.sum((1, 2)) != every.slot_bytes[learnt]).any():
        raise _fed_other()  # (or fed less than whole)
    feeds.per_bytes.reshape(n_k, -1)[learnt] = pb[learnt]
    feeds.per_boxes.reshape(n_k, -1)[learnt] = px[learnt]
    feeds.present[learnt] = present[learnt]
    feeds.known[learnt] = True
    feeds.read[fresh] = True
    feeds.other[fresh] = other


def _shape(feeds: Feeds, need: np.ndarray,
           affected: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, bool]:
    """For the rows made into the stacked tensors `need`: per weight, the source ranks
    feeding it (in order, padded with 0), None where they differ from tensor to tensor
    (the rows are then sorted); their number; whether an `affected` tensor also feeds other
    tensors than the stacked ones (its rows then merged)."""
    present = feeds.present[need]
    n_w = present.shape[2]
    lists, regular = [], True
    for j in range(n_w):
        at_w = present[:, :, j][present[:, :, j].any(1)]
        regular &= bool((at_w == at_w[:1]).all())
        lists.append(np.flatnonzero(at_w[0]) if len(at_w) else np.zeros(0, np.int64))
    n_src = np.array([len(x) for x in lists], np.int64)
    srcs = np.zeros((n_w, max(1, int(n_src.max()) if n_w else 1)), np.int64)
    for j, x in enumerate(lists):
        srcs[j, :len(x)] = x
    return srcs if regular else None, n_src, bool(feeds.other[affected].any())


def _rows(feeds: Feeds, srcs: np.ndarray | None, n_src: np.ndarray, region: np.ndarray,
          hold: np.ndarray, affected: np.ndarray, ids: ExpertIds,
          sources: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The rows into stacked tensors of the experts made again (`hold`: their slots in each
    stacked tensor, zero for the others; `affected`: their spec tensors, sorted; `srcs`,
    `n_src`: `_shape`'s; `region`: `_regions` of `affected`): explain's columns, sorted as
    the table, and each affected tensor's number of rows."""
    every, n_w = feeds.every, ids.ids.shape[2]
    n_k = len(every.key)
    uk, ue = np.nonzero(hold)  # (stacked tensor, expert) pairs made again
    unit = []
    for j in range(n_w):
        on = feeds.present[uk, :, j].any(1)
        unit.append((ids.ids[every.moe[uk[on]], ue[on], j], uk[on], hold[uk[on], ue[on]],
                     np.full(int(on.sum()), j, np.int64)))
    ug, uk, uc, uw = (np.concatenate(c) for c in zip(*unit))
    order = np.argsort(ug * n_k + uk)  # tensor by tensor, each's in the table's order
    ug, uk, uc, uw = ug[order], uk[order], uc[order], uw[order]
    pos = np.searchsorted(affected, ug)  # each unit's tensor among `affected`
    base = uk * sources * n_w + uw  # (tensor, source 0, weight) of each unit
    if srcs is not None:
        g_start = np.flatnonzero(np.concatenate([[True], ug[1:] != ug[:-1]]))
        m = np.diff(np.append(g_start, len(ug)))  # units of each spec tensor
        g_w = uw[g_start]
        length = m * n_src[g_w]
        r = int(length.sum())
        g = np.repeat(np.arange(len(g_start)), length)
        local = np.arange(r) - np.repeat(np.cumsum(length) - length, length)
        i, jj = np.divmod(local, m[g])  # source, unit: a tensor's rows are source-major
        del local
        u = g_start[g] + jj
        used = np.zeros(len(srcs), bool)
        used[g_w] = True
        if (srcs[used] == np.arange(srcs.shape[1])).all():  # every weight fed by sources
            s = i  # 0, 1, ... (each one): a row's source rank is its index
        else:
            s = srcs[g_w[g], i] if len(n_src) > 1 else srcs[0][i]
        del g, jj
        tensor = np.repeat(ug[g_start].astype(np.int32), length)
        n = np.zeros(len(affected), np.int64)
        n[np.searchsorted(affected, ug[g_start])] = length
    else:  # each unit its own source ranks: made unit by unit, sorted
        pu, s = np.nonzero(feeds.present[uk, :, uw])
        order = lexorder(uk[pu], s, ug[pu])
        u, s = pu[order], s[order]
        tensor = ug[u]
        n = np.bincount(np.searchsorted(affected, ug), weights=feeds.present[uk, :, uw].sum(1),
                        minlength=len(affected)).astype(np.int64)
    idx = base[u]
    idx += s * n_w
    cnt = uc[u]
    at = s * len(affected)
    at += pos[u]
    src_region = region.reshape(-1)[at]
    del at
    nbytes, boxes = feeds.per_bytes[idx], feeds.per_boxes[idx]
    del idx
    nbytes *= cnt
    boxes *= cnt
    del cnt
    cols = [tensor, s, src_region, every.rank[uk].astype(np.int32)[u],
            every.region[uk].astype(np.int32)[u], nbytes, boxes]
    return cols, n


def _merged(table: Table, feeds: Feeds, starts: np.ndarray, affected: np.ndarray,
            cols: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """`cols` with the affected tensors' rows into tensors other than the stacked ones,
    all sorted as the table; each affected tensor's number of rows."""
    within, _ = _ranges(starts, affected)
    sub, _ = feeds.every.find(table["dst_rank"][within], table["dst_region"][within])
    other = np.ones(len(within), bool)
    other[sub] = False
    other = within[other]
    block = np.concatenate([np.stack([table[c][other].astype(np.int64)
                                      for c, _ in EXPLAIN_COLUMNS]), np.stack(cols)], 1)
    block = block[:, lexorder(*block[4::-1])]
    n = np.bincount(np.searchsorted(affected, block[0]), minlength=len(affected))
    return list(block), n


def _spliced(table: Table, starts: np.ndarray, affected: np.ndarray, lengths: np.ndarray,
             cols: list[np.ndarray], regular: bool) -> Table:
    """`table` with the rows of each tensor `affected[j]` (sorted, as the table is)
    replaced by the `lengths[j]` rows of `cols` of that tensor (`cols`: the columns,
    sorted), run by run of adjacent affected tensors. Where every tensor keeps its row
    count, the table's columns are copied and the new rows written over; made in order
    (`regular`), an expert keeps its source ranks and number of stacked tensors, so
    `tensor`, `src_rank` and `src_region` stay the old table's arrays. Else each column is
    made anew from the old rows between the runs and the new rows."""
    lo, hi = starts[affected], starts[affected + 1]
    n = len(table)
    same = np.array_equal(hi - lo, lengths)
    cut = np.flatnonzero(lo[1:] != hi[:-1]) + 1  # runs of adjacent affected tensors
    first, last = np.concatenate([[0], cut]), np.append(cut, len(lo)) - 1
    end = np.cumsum(lengths)
    old_lo, old_hi, new_lo, new_hi = lo[first], hi[last], end[first] - lengths[first], end[last]
    shift = (new_hi - new_lo) - (old_hi - old_lo)
    runs = list(zip(*(x.tolist() for x in (old_lo, old_hi, new_lo, new_hi))))
    size = n + int(shift.sum())
    out: dict[str, Any] = {}
    for (name, dt), c, col in zip(EXPLAIN_COLUMNS, cols, table.columns):
        if same and regular and name in ("tensor", "src_rank", "src_region"):
            out[name] = col
            continue
        if same:
            o = np.array(col, dtype=dt)
            for a, b, x, y in runs:
                o[a:b] = c[x:y]
        else:
            o, prev, pos = np.empty(size, dt), 0, 0
            for a, b, x, y in runs:
                o[pos:pos + a - prev] = col[prev:a]
                pos += a - prev
                o[pos:pos + y - x] = c[x:y]
                pos, prev = pos + y - x, b
            o[pos:] = col[prev:]
        out[name] = o
    return Table.build(EXPLAIN_COLUMNS, **out)
