"""The replan's explain rows (`planner/replan.py`): the rows of the experts whose count of
slots in some stacked expert tensor changes, made again from what one slot of each
(stacked tensor, source rank, weight) is fed, put in the table in its order.

What one slot is fed (`Feeds`) is read from the table once, with the checks that make the
rows of every expert a product of it (each expert of a stacked tensor fed by the same
source ranks, each the same bytes and boxes per slot it holds), and kept for the table the
replan makes (which it never changes), with where each tensor's rows start: the next
replan reads neither again. An expert's rows are then its source ranks, in order, each
once per stacked tensor holding it, in (target rank, region) order (the table's sort)."""

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
    boxes (-1: none)."""

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
    fed: np.ndarray
    """(tensor, weight): whether some source feeds that weight."""
    sources: np.ndarray | None
    """Per weight, the source ranks feeding it (in order, padded with 0), the same for every
    tensor fed that weight; None where they differ (the rows are then sorted)."""
    n_sources: np.ndarray
    region: np.ndarray
    """Source rank x spec tensor: the tensor's region on that rank (-1: none), flat."""
    other: bool
    """Whether some expert tensor's rows go into other tensors than the stacked ones."""


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
    feeds, starts = _kept(table, slots, ids, old, src, sources)
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
    cols, lengths, regular = _rows(feeds, after, changed, affected, ids, sources)
    if feeds.other:  # the affected tensors' rows into other tensors: kept, merged in
        cols, lengths = _merged(table, feeds, starts, affected, cols)
        regular = False
    out = _spliced(table, starts, affected, lengths, cols, regular)
    counts = np.diff(starts)
    counts[affected] = lengths
    _keep(out, slots, ids, feeds, np.concatenate([[0], np.cumsum(counts)]))
    return out


def _kept(table: Table, slots: list[Slots], ids: ExpertIds, old: Placement,
          src: SourceTensors, sources: int) -> tuple[Feeds, np.ndarray]:
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
    feeds = _feeds(table, every, kk, at, counts, starts, old, src, ids, sources)
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


def _feeds(table: Table, every: Hits, kk: np.ndarray, at: np.ndarray, counts: np.ndarray,
           starts: np.ndarray, old: Placement, src: SourceTensors, ids: ExpertIds,
           sources: int) -> Feeds:
    """`Feeds` of the explain table `table` (placement `old`; `counts` and `starts`: its
    rows of each spec tensor, where they start), its rows checked: each expert tensor's row
    into a stacked tensor is one of its experts' (of that MoE layer), from a source rank,
    the source region the rank holds the expert in, and its bytes and boxes the same
    multiple of the expert's slots there for every expert of the tensor; every expert of a
    tensor is fed by the same source ranks; the tensor is fed whole by them (so by no other
    tensor: a plan writes each byte once)."""
    n_k, n_w, n_t = len(every.key), ids.ids.shape[2], len(ids.layer)
    before = _counts(every, kk, at, old, ids)
    rows, k = every.find(table["dst_rank"], table["dst_region"])  # into stacked tensors
    t = table["tensor"][rows]
    e, w = ids.expert[t], ids.weight[t]
    if (ids.layer[t] != every.moe[k]).any():  # (not an expert tensor: -1)
        raise _fed_other()
    s = table["src_rank"][rows]
    if len(s) and (s.min() < 0 or s.max() >= sources):
        raise NotIncremental("replan: a stacked expert tensor is fed by a target rank "
                             "(copied or gathered there); compile the new placement in full")
    region = np.stack([src.of(r)[0] for r in range(sources)]) if sources else np.zeros(
        (0, n_t), np.int64)
    if (region[s, t] != table["src_region"][rows]).any():
        raise NotIncremental("replan: a stacked expert tensor is fed from a source region "
                             "that does not hold the expert; compile the new placement in "
                             "full")
    n = before[k, e]
    if (n == 0).any():
        raise NotIncremental("replan: a stacked expert tensor is fed an expert it does not "
                             "hold: the plan is corrupt: recompile it")
    nbytes, boxes = table["nbytes"][rows], table["boxes"][rows]  # (copies: divided below)
    fed = np.bincount(k, weights=nbytes, minlength=n_k)  # exact below 2^53
    key = k.astype(np.int64)
    key *= sources
    key += s
    key *= n_w
    key += w
    size = n_k * sources * n_w
    pb, px = np.full(size, -1, np.int64), np.full(size, -1, np.int64)
    multi = np.flatnonzero(n != 1)  # rows of experts held in several slots: divided
    n_m, whole_b, whole_x = n[multi], nbytes[multi], boxes[multi]
    share_b, share_x = nbytes, boxes
    share_b[multi] = whole_b // n_m
    share_x[multi] = whole_x // n_m
    pb[key], px[key] = share_b, share_x
    if ((pb[key] != share_b).any() or (px[key] != share_x).any()
            or (share_b[multi] * n_m != whole_b).any()
            or (share_x[multi] * n_m != whole_x).any()):
        raise _uneven()  # one slot's share is not the same for every expert (or no share)
    present = np.bincount(key, minlength=size)  # rows of each (tensor, source, weight)
    distinct = np.count_nonzero(before, axis=1)  # experts each tensor holds
    if (present.reshape(n_k, -1) % np.maximum(distinct, 1)[:, None]).any() or (
            present.reshape(n_k, -1) > distinct[:, None]).any():
        raise _uneven()  # some expert of a tensor not fed by a source that feeds the others
    if (fed != every.slot_bytes * every.count).any():
        raise _fed_other()
    present = present.reshape(n_k, sources, n_w) > 0
    lists, regular = [], True
    for j in range(n_w):
        at_w = present[:, :, j][present[:, :, j].any(1)]
        regular &= bool((at_w == at_w[:1]).all())
        lists.append(np.flatnonzero(at_w[0]) if len(at_w) else np.zeros(0, np.int64))
    n_src = np.array([len(x) for x in lists], np.int64)
    srcs = np.zeros((n_w, max(1, int(n_src.max()) if n_w else 1)), np.int64)
    for j, x in enumerate(lists):
        srcs[j, :len(x)] = x
    experts = int(counts[ids.layer >= 0].sum())
    return Feeds(every, kk, at, pb, px, present, present.any(1), srcs if regular else None,
                 n_src,
                 region.reshape(-1), experts != len(rows))


def _rows(feeds: Feeds, after: np.ndarray, changed: np.ndarray, affected: np.ndarray,
          ids: ExpertIds, sources: int) -> tuple[list[np.ndarray], np.ndarray, bool]:
    """The rows into stacked tensors of the experts `changed` (`affected`: their spec
    tensors, sorted) under the counts `after`: explain's columns, sorted as the table, and
    each affected tensor's number of rows; whether the rows were made in order (not sorted)."""
    every, n_w = feeds.every, ids.ids.shape[2]
    n_k = len(every.key)
    hold = after * changed[every.moe]
    uk, ue = np.nonzero(hold)  # (stacked tensor, expert) pairs made again
    unit = []
    for j in range(n_w):
        on = feeds.fed[uk, j]
        unit.append((ids.ids[every.moe[uk[on]], ue[on], j], uk[on], hold[uk[on], ue[on]],
                     np.full(int(on.sum()), j, np.int64)))
    ug, uk, uc, uw = (np.concatenate(c) for c in zip(*unit))
    order = np.argsort(ug * n_k + uk)  # tensor by tensor, each's in the table's order
    ug, uk, uc, uw = ug[order], uk[order], uc[order], uw[order]
    base = uk * sources * n_w + uw  # (tensor, source 0, weight) of each unit
    if feeds.sources is not None:
        g_start = np.flatnonzero(np.concatenate([[True], ug[1:] != ug[:-1]]))
        m = np.diff(np.append(g_start, len(ug)))  # units of each spec tensor
        g_w = uw[g_start]
        length = m * feeds.n_sources[g_w]
        r = int(length.sum())
        g = np.repeat(np.arange(len(g_start)), length)
        local = np.arange(r) - np.repeat(np.cumsum(length) - length, length)
        i, jj = np.divmod(local, m[g])  # source, unit: a tensor's rows are source-major
        del local
        u = g_start[g] + jj
        s = feeds.sources[g_w[g], i] if len(feeds.n_sources) > 1 else feeds.sources[0][i]
        del g, i, jj
        tensor = np.repeat(ug[g_start], length)
        n = np.zeros(len(affected), np.int64)
        n[np.searchsorted(affected, ug[g_start])] = length
    else:  # each unit its own source ranks: made unit by unit, sorted
        pu, s = np.nonzero(feeds.present[uk, :, uw])
        order = lexorder(uk[pu], s, ug[pu])
        u, s = pu[order], s[order]
        tensor = ug[u]
        n = np.bincount(np.searchsorted(affected, ug), weights=feeds.present[uk, :, uw].sum(1),
                        minlength=len(affected)).astype(np.int64)
    idx = base[u] + s * n_w
    cnt = uc[u]
    cols = [tensor, s, feeds.region[s * len(ids.layer) + tensor],
            every.rank[uk][u], every.region[uk][u], feeds.per_bytes[idx] * cnt,
            feeds.per_boxes[idx] * cnt]
    return cols, n, feeds.sources is not None


def _merged(table: Table, feeds: Feeds, starts: np.ndarray, affected: np.ndarray,
            cols: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """`cols` with the affected tensors' rows into tensors other than the stacked ones,
    all sorted as the table; each affected tensor's number of rows."""
    lo, hi = starts[affected], starts[affected + 1]
    span = hi - lo
    within = np.repeat(lo - np.cumsum(span) + span, span) + np.arange(int(span.sum()))
    sub, _ = feeds.every.find(table["dst_rank"][within], table["dst_region"][within])
    other = np.ones(len(within), bool)
    other[sub] = False
    other = within[other]
    block = np.concatenate([np.stack([table[c][other].astype(np.int64)
                                      for c, _ in EXPLAIN_COLUMNS]), np.stack(cols)], 1)
    block = block[:, lexorder(*block[4::-1])]
    n = np.bincount(np.searchsorted(affected, block[0]), minlength=len(affected))
    return list(block), n


def _runs(lo: np.ndarray, hi: np.ndarray, n: int) -> np.ndarray:
    """A mask of `n` rows, true in the runs `[lo[j], hi[j])` (sorted, apart)."""
    gaps = lo - np.concatenate([[0], hi[:-1]])
    lengths = np.empty(2 * len(lo) + 1, np.int64)
    lengths[0:-1:2], lengths[1::2], lengths[-1] = gaps, hi - lo, n - (hi[-1] if len(hi) else 0)
    pattern = np.zeros(len(lengths), bool)
    pattern[1::2] = True
    return np.repeat(pattern, lengths)


def _spliced(table: Table, starts: np.ndarray, affected: np.ndarray, lengths: np.ndarray,
             cols: list[np.ndarray], regular: bool) -> Table:
    """`table` with the rows of each tensor `affected[j]` (sorted, as the table is)
    replaced by the `lengths[j]` rows of `cols` of that tensor (`cols`: the columns,
    sorted). Where every tensor keeps its row count, the table's columns are copied and
    the new rows written over; made in order (`regular`), an expert keeps its source ranks
    and number of stacked tensors, so `tensor`, `src_rank` and `src_region` stay the old
    table's arrays. Else the old rows kept and the new ones are put in place by mask."""
    lo, hi = starts[affected], starts[affected + 1]
    n, span = len(table), hi - lo
    out: dict[str, Any] = {}
    new = _runs(lo, hi, n)
    same = np.array_equal(span, lengths)
    if not same:
        keep = ~new
        at = lo + np.cumsum(lengths - span) - (lengths - span)  # shifted by those before
        size = n + int(lengths.sum() - span.sum())
        new = _runs(at, at + lengths, size)
    for (name, dt), c, col in zip(EXPLAIN_COLUMNS, cols, table.columns):
        if same and regular and name in ("tensor", "src_rank", "src_region"):
            out[name] = col
            continue
        if same:
            o = np.array(col, dtype=dt)
        else:
            o = np.empty(size, dt)
            o[~new] = col[keep]
        o[new] = c
        out[name] = o
    return Table.build(EXPLAIN_COLUMNS, **out)
