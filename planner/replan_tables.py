"""The replan's indexes and its rewrite of the plan's descriptive parts (`planner/replan.py`
edits the writes): the hit target tensors (`Slots`, `Hits`), each source rank's expert
tensors (`SourceTensors`), the explain rows into the hit tensors (`explain`) and the target
ranks' `tensors/<rank>` blobs (`target_blobs`), each as a full compile gives them."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from planner.errors import NotIncremental
from planner.placement import ExpertIds, ep_rank
from planner.rows import lexorder
from planner.spec import ModelSpec
from schemas.header import PlanHeader
from schemas.placement import Placement
from schemas.plan import EXPLAIN_COLUMNS, Plan, RankPlan
from schemas.table import Table
from schemas.tensors import PIECE_COLUMNS, encode_rank_tensors

_SLOT_TENSOR = re.compile(
    r"^model\.layers\.(\d+)\..*experts\.(?:routed_experts\.)?(w13|w2)_weight$")


@dataclasses.dataclass(frozen=True)
class Slots:
    """One target region of stacked experts (w13 or w2 of one MoE layer on one rank)."""

    rank: int
    region: int
    moe: int
    first: int
    """Global physical slot of its local slot 0."""
    count: int
    slot_bytes: int


_SLOTS_KEPT: list[tuple[tuple[Any, ...], tuple[Any, ...], list[Slots]]] = []


def slot_regions(plan: Plan, h: PlanHeader, moe_layers: tuple[int, ...]) -> list[Slots]:
    """Every target region of stacked experts (the last few plans' kept, by the identity
    of their target regions: a replan keeps them, so the next replan finds them)."""
    key = (h.identities, *(rp.regions for rp in plan.ranks[h.sources:]))
    alike = (moe_layers, h.target.engine if h.target is not None else None)
    for kept, kept_alike, slots in _SLOTS_KEPT:
        if kept_alike == alike and len(kept) == len(key) and all(
                a is b for a, b in zip(kept, key)):
            return slots
    slots = list(_slot_regions(plan, h, moe_layers))
    _SLOTS_KEPT.append((key, alike, slots))
    del _SLOTS_KEPT[:-2]
    return slots


def _slot_regions(plan: Plan, h: PlanHeader, moe_layers: tuple[int, ...]) -> Iterator[Slots]:
    moe = {layer: i for i, layer in enumerate(moe_layers)}
    for rp in plan.ranks[h.sources:]:
        ep = ep_rank(h, rp.rank)
        for i, reg in enumerate(rp.regions):
            if not reg.name.endswith("_weight"):
                continue
            m = _SLOT_TENSOR.match(reg.name)
            if m is None or int(m[1]) not in moe or len(reg.shape) != 3 or not reg.shape[0]:
                continue
            n = reg.shape[0]
            yield Slots(rp.rank, i, moe[int(m[1])], ep * n, n, reg.nbytes // n)


_SOURCES_KEEP = 64
_SOURCES_KEPT: list[tuple[dict[str, Any], ModelSpec, int, tuple[Any, ...]]] = []
"""`SourceTensors`' indexes of the last few source blobs, by the blob's identity (a replan
passes the source ranks' blobs on as they are, so the next replan finds them; ranks whose
blob is `same_as` another's share one)."""


class SourceTensors:
    """Per source rank, from its `tensors/<rank>` blob: the region holding each logical
    tensor (-1: none) and, asked for, the geometry of that piece, for the expert tensors."""

    _GEOMETRY = ("off0", "off1", "size0", "size1", "start", "stride0", "stride1")

    def __init__(self, plan: Plan, sources: int, spec: ModelSpec, ids: ExpertIds) -> None:
        self.blobs = dict(plan.extra_blobs)
        self.plan, self.spec, self.ids = plan, spec, ids
        self.index = ids.index
        self._cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, Table]] = {}

    def of(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(region of each spec tensor id, spec tensor id of each region (-1: none))."""
        region, gid_of_region, _, _ = self._of(rank)
        return region, gid_of_region

    def geometry(self, rank: int, gid: np.ndarray) -> np.ndarray:
        """Where the piece of spec tensor `gid[i]` sits in its tensor, as one class number
        per tensor (equal numbers: equal offsets, sizes, start and strides)."""
        return self._of(rank)[2][gid]

    def _of(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, Table]:
        if rank not in self._cache:
            blob = resolve(self.blobs, rank)
            nreg = len(self.plan.ranks[rank].regions)
            for kept, kept_spec, kept_nreg, value in _SOURCES_KEPT:
                if kept is blob and kept_spec is self.spec and kept_nreg == nreg:
                    self._cache[rank] = value
                    return value
            t = Table.from_msgpack(PIECE_COLUMNS, blob["pieces"], f"tensors/{rank}")
            gid = spec_ids(blob["names"], self.spec, self.index)[t["tensor"]]
            n = len(self.spec.tensors)
            expert = np.flatnonzero(self.ids.layer[gid] >= 0)
            g, reg = gid[expert], t["region"][expert].astype(np.int64)
            held = np.unique(self.ids.layer[g] * self.ids.ids.shape[1] + self.ids.expert[g])
            if len(held) < self.ids.ids.shape[0] * self.ids.ids.shape[1]:
                raise NotIncremental(
                    f"replan: source rank {rank} holds {len(held)} of the "
                    f"{self.ids.ids.shape[0] * self.ids.ids.shape[1]} (MoE layer, expert) "
                    "pairs (experts on EP ranks, e.g. Megatron EP): a moved slot's bytes then "
                    "come from another source rank, so its writes leave one rank's batches "
                    "and signals for another's, and `assign` (which balances every chunk's "
                    "source over the NICs) and the staging layout of both ranks change with "
                    "them; only a full compile gives those: compile the new placement in full")
            if len(g) and (np.bincount(g).max() > 1 or np.bincount(reg).max() > 1):
                raise NotIncremental(f"replan: source rank {rank} holds an expert in several "
                                     "pieces or several experts (or weights) in one tensor "
                                     "(a grouped or fused expert tensor): a moved slot's "
                                     "bytes then sit at other offsets of that tensor, which "
                                     "changes the writes' cut and order; compile the new "
                                     "placement in full")
            region = np.full(n, -1, np.int64)
            region[g] = reg
            geo = np.full(n, -1, np.int64)  # the geometry class of each expert tensor
            if len(g):
                cols = np.stack([t[c][expert].astype(np.int64) for c in self._GEOMETRY], 1)
                order = np.lexsort(cols.T[::-1])
                step = np.ones(len(order), bool)
                step[1:] = (cols[order[1:]] != cols[order[:-1]]).any(1)
                geo[g[order]] = np.cumsum(step)
            gid_of_region = np.full(nreg, -1, np.int64)
            gid_of_region[reg[reg < nreg]] = g[reg < nreg]
            self._cache[rank] = (region, gid_of_region, geo, t)
            _SOURCES_KEPT.append((blob, self.spec, nreg, self._cache[rank]))
            del _SOURCES_KEPT[:-_SOURCES_KEEP]
        return self._cache[rank]

    def regions(self, rank: np.ndarray, gid: np.ndarray) -> np.ndarray:
        """The region of spec tensor `gid[i]` on source rank `rank[i]`."""
        if not len(rank):
            return np.zeros(0, np.int64)
        ranks = np.unique(rank)
        table = np.stack([self._of(r)[0] for r in ranks.tolist()])
        return table[np.searchsorted(ranks, rank), gid]


def spec_ids(names: list[str], spec: ModelSpec, index: dict[str, int]) -> np.ndarray:
    """Spec ids of a blob's names (sorted by id: `identities._blob`; all of them: arange)."""
    if len(names) == len(spec.tensors):
        return np.arange(len(names), dtype=np.int64)
    return np.array([index[n] for n in names], np.int64)


def resolve(blobs: dict[str, Any], rank: int) -> dict[str, Any]:
    blob = blobs[f"tensors/{rank}"]
    if "same_as" in blob:
        blob = blobs[f"tensors/{blob['same_as']}"]
    return blob


class Hits:
    """The hit target regions as columns, looked up by (plan rank, region)."""

    def __init__(self, hit: list[Slots]) -> None:
        self.rank, self.region, self.moe, self.first, self.count, self.slot_bytes = (
            np.array([getattr(s, f) for s in hit], np.int64)
            for f in ("rank", "region", "moe", "first", "count", "slot_bytes"))
        self.key = self.rank << 32 | self.region
        width = int(self.region.max()) + 1 if len(hit) else 0
        self.index = np.full((int(self.rank.max()) + 1 if len(hit) else 0, width), -1,
                             np.int64)  # (rank, region) -> hit index, -1: not hit
        self.index[self.rank, self.region] = np.arange(len(hit))

    def find(self, rank: np.ndarray, region: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows whose (rank, region) is hit, the hit index of each)."""
        n, width = self.index.shape
        inside = (rank < n) & (region < width)
        flat = self.index.reshape(-1)
        at = np.where(inside, rank.astype(np.int64) * width + region, 0)
        h = np.where(inside, flat[at] if flat.size else -1, -1)
        rows = np.flatnonzero(h >= 0)
        return rows, h[rows]


def explain(table: Table, hits: Hits, old: Placement, new: Placement,
             src: SourceTensors, ids: ExpertIds, sources: int) -> Table:
    """The explain table with the rows into each hit target tensor made again from the new
    slot contents: per (source rank, weight) a slot's share, the same for every expert,
    times the slots of the tensor holding each expert. Only the rows of the experts whose
    count of slots in some hit tensor changed are read and made again (the table is sorted
    by tensor); every other expert's rows stay as they are."""
    if not len(table):
        return table
    col = {name: table[name] for name, _ in EXPLAIN_COLUMNS}
    tensor = col["tensor"]
    n_hit, n_exp = len(hits.key), ids.ids.shape[1]
    hh = np.repeat(np.arange(n_hit), hits.count)
    g = hits.first[hh] + np.arange(len(hh)) - np.repeat(np.cumsum(hits.count) - hits.count,
                                                          hits.count)
    was, now = old.table[hits.moe[hh], g], new.table[hits.moe[hh], g]
    before, after = (np.bincount(hh * n_exp + e, minlength=n_hit * n_exp).reshape(n_hit, n_exp)
                     for e in (was, now))
    ch, ce = np.nonzero(before != after)
    changed = np.zeros(ids.ids.shape[:2], bool)  # (MoE layer, expert) whose rows change
    changed[hits.moe[ch], ce] = True
    mask = changed[hits.moe]  # per hit tensor, the experts made again
    before, after = before * mask, after * mask
    affected = ids.ids[changed].reshape(-1)
    affected = np.unique(affected[affected >= 0])
    lo = np.searchsorted(tensor, affected, "left")
    span = np.searchsorted(tensor, affected, "right") - lo
    span_start = np.cumsum(span) - span
    within = np.repeat(lo - span_start, span) + np.arange(int(span.sum()))  # their rows
    sub, h = hits.find(col["dst_rank"][within], col["dst_region"][within])
    rows = within[sub]
    fed = np.bincount(h, weights=col["nbytes"][rows], minlength=n_hit)
    if (fed != hits.slot_bytes * before.sum(1)).any():
        raise NotIncremental("replan: a stacked expert tensor is fed other tensors; compile "
                             "the new placement in full")
    t = tensor[rows].astype(np.int64)
    e, wt = ids.expert[t], ids.weight[t]
    if (e < 0).any() or (ids.layer[t] != hits.moe[h]).any():
        raise NotIncremental("replan: a stacked expert tensor is fed other tensors; compile "
                             "the new placement in full")
    n = before[h, e]
    nbytes, boxes = col["nbytes"][rows].astype(np.int64), col["boxes"][rows].astype(np.int64)
    per_bytes, per_boxes = nbytes // n, boxes // n
    # one template row per (hit, source rank, weight): a slot's bytes and boxes from it
    s_col = col["src_rank"][rows].astype(np.int64)
    n_src, n_w = int(s_col.max()) + 1 if len(s_col) else 1, ids.ids.shape[2]
    _, first, inverse = np.unique((h * n_src + s_col) * n_w + wt, return_index=True,
                                  return_inverse=True)
    tmpl = np.stack([h[first], s_col[first], wt[first], per_bytes[first], per_boxes[first]], 1)
    inverse = inverse.reshape(-1)
    if ((tmpl[inverse, 3] != per_bytes) | (tmpl[inverse, 4] != per_boxes)).any() or (
            (nbytes % n) | (boxes % n)).any():
        raise NotIncremental("replan: the slots of one target tensor are fed unevenly by its "
                             "experts; compile the new placement in full")
    th, pe = np.nonzero(after)  # (hit, expert) pairs of the new placement, hit-major
    t_start = np.searchsorted(tmpl[:, 0], np.arange(n_hit))
    t_count = np.bincount(tmpl[:, 0], minlength=n_hit)
    p_start = np.searchsorted(th, np.arange(n_hit))
    p_count = np.bincount(th, minlength=n_hit)
    each = t_count * p_count
    hx = np.repeat(np.arange(n_hit), each)
    k = np.arange(len(hx)) - np.repeat(np.cumsum(each) - each, each)
    ti = t_start[hx] + k // np.maximum(p_count[hx], 1)
    pi = p_start[hx] + k % np.maximum(p_count[hx], 1)
    ex, cnt = pe[pi], after[th[pi], pe[pi]]
    s_rank = tmpl[ti, 1]
    gid = ids.ids[hits.moe[hx], ex, tmpl[ti, 2]]
    reg = src.regions(s_rank, gid)
    extra = np.stack([gid, s_rank, reg, hits.rank[hx], hits.region[hx], tmpl[ti, 3] * cnt,
                      tmpl[ti, 4] * cnt])
    other = np.ones(len(within), bool)
    other[sub] = False
    other = within[other]  # the affected tensors' rows into other tensors: kept as they are
    block = np.concatenate([np.stack([col[c][other] for c, _ in EXPLAIN_COLUMNS]), extra], 1)
    return _spliced(table, col, lo, lo + span, affected, block[:, _block_order(block, len(other))])


def _block_order(block: np.ndarray, sorted_first: int) -> np.ndarray:
    """The order of `block`'s rows by (tensor, src_rank, src_region, dst_rank, dst_region),
    its first `sorted_first` rows in that order already: the others sorted and merged in
    by one combined key where it fits in 63 bits."""
    keys = block[:5]
    bits = [int(k.max()).bit_length() if k.size else 0 for k in keys]
    if not block.shape[1] or sum(bits) > 63 or (keys.min() < 0 if keys.size else False):
        return lexorder(*block[4::-1])
    key = keys[0].copy()
    for k, b in zip(keys[1:], bits[1:]):
        key <<= b
        key |= k
    head, tail = key[:sorted_first], key[sorted_first:]
    if (np.diff(head) <= 0).any():
        return lexorder(*block[4::-1])
    order = np.argsort(tail, kind="stable") + sorted_first
    at = np.searchsorted(head, key[order], "right")
    return np.insert(np.arange(sorted_first), at, order)


def _spliced(table: Table, col: dict[str, np.ndarray], lo: np.ndarray, hi: np.ndarray,
             affected: np.ndarray, block: np.ndarray) -> Table:
    """`table` with the rows `[lo[j], hi[j])` of each tensor `affected[j]` (sorted, as the
    table is) replaced by `block`'s rows of that tensor (`block`: columns x rows, sorted).

    Where every tensor keeps its row count (most placement changes), the table is copied
    and the block written over those rows (a column they leave unchanged is kept as it
    is); else the tensors whose row count changes cut the table into runs, each column is
    those runs and their block rows copied in order, and the other affected tensors' block
    rows written over their rows, shifted."""
    b_lo = np.searchsorted(block[0], affected, "left")
    b_hi = np.searchsorted(block[0], affected, "right")
    span, b_len = hi - lo, b_hi - b_lo
    n = len(table)
    out = {}
    if np.array_equal(span, b_len):
        at = np.repeat(lo - np.cumsum(span) + span, span) + np.arange(int(span.sum()))
        for i, (name, dt) in enumerate(EXPLAIN_COLUMNS):
            c = col[name]
            if i and not np.array_equal(c[at], block[i]):  # `tensor` keeps its runs
                c = np.array(c, dtype=dt)
                c[at] = block[i]
            out[name] = c  # an unchanged column is the old table's (read-only) array
        return Table.build(EXPLAIN_COLUMNS, **out)
    # the tensors whose row count changes cut the table into runs, copied in output order
    # (kept rows, then that tensor's block rows); the other affected tensors' rows are
    # written over, at their place shifted by the row counts changed before them
    cut = np.flatnonzero(span != b_len)
    shift = np.zeros(len(affected), np.int64)
    shift[cut] = b_len[cut] - span[cut]
    shift = np.cumsum(shift) - shift  # of each affected tensor's first row
    eq = np.flatnonzero(span == b_len)
    at = np.repeat(lo[eq] + shift[eq] - np.cumsum(span[eq]) + span[eq], span[eq]) + np.arange(
        int(span[eq].sum()))
    b_at = np.repeat(b_lo[eq] - np.cumsum(span[eq]) + span[eq], span[eq]) + np.arange(
        int(span[eq].sum()))
    edges = np.stack([np.append(0, hi[cut]), np.append(lo[cut], n)], 1).tolist()
    b_edges = np.stack([b_lo[cut], b_hi[cut]], 1).tolist()
    for i, (name, dt) in enumerate(EXPLAIN_COLUMNS):
        c, bc = col[name], block[i].astype(dt)
        parts = [c[edges[0][0]:edges[0][1]]]
        for (blo, bhi), (klo, khi) in zip(b_edges, edges[1:]):
            parts += [bc[blo:bhi], c[klo:khi]]
        out[name] = np.concatenate(parts)
        out[name][at] = bc[b_at]
    return Table.build(EXPLAIN_COLUMNS, **out)


def target_blobs(plan: Plan, hit: list[Slots], old: Placement, new: Placement,
                  spec: ModelSpec, ids: ExpertIds, sources: int) -> tuple[tuple[str, Any], ...]:
    """Every `tensors/<rank>` blob, the hit target ranks' made again (names and pieces of
    the moved slots), target blobs equal to an earlier rank's as `same_as` it."""
    blobs = dict(plan.extra_blobs)
    by_rank: dict[int, list[Slots]] = {}
    for s in hit:
        by_rank.setdefault(s.rank, []).append(s)
    content: dict[int, dict[str, Any]] = {}
    for r in range(sources, len(plan.ranks)):
        blob = resolve(blobs, r)
        if r in by_rank:
            blob = _patched(blob, plan.ranks[r], by_rank[r], old, new, spec, ids)
        content[r] = blob
    first: dict[Any, list[tuple[dict[str, Any], int]]] = {}

    def earlier(blob: dict[str, Any], r: int) -> int:
        """The first rank seen with content equal to `blob` (`r` if none)."""
        alike = first.setdefault(_key(blob), [])
        for other, at in alike:
            if other is blob or _equal(other, blob):
                return at
        alike.append((blob, r))
        return r

    shapes = {_shape(c) for c in content.values()}  # a source blob can equal a target one
    for name, _ in plan.extra_blobs:  # only if alike in shape: the others are not compared
        r = int(name.split("/")[1])
        if r < sources and _shape(resolve(blobs, r)) in shapes:
            earlier(resolve(blobs, r), r)
    out = []
    for name, blob in plan.extra_blobs:
        r = int(name.split("/")[1])
        if r >= sources:
            c = content[r]
            same = earlier(c, r)
            blob = c if same == r else {"same_as": same}
        out.append((name, blob))
    return tuple(out)


def _shape(blob: dict[str, Any]) -> tuple[int, int, int]:
    return len(blob["names"]), len(blob["buffer"]), len(blob["pieces"][0])


def _key(blob: dict[str, Any]) -> tuple[Any, ...]:
    """A blob's content hashed cheaply (equal content, equal key): its piece columns and
    buffer; blobs of equal keys are then compared whole."""
    return (_shape(blob), blob["buffer"], *blob["pieces"])


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two blobs pack to the same bytes (shapes as lists or tuples alike)."""
    return (a.keys() == b.keys() and a["names"] == b["names"] and a["buffer"] == b["buffer"]
            and a["pieces"] == b["pieces"] and len(a["shapes"]) == len(b["shapes"])
            and all(tuple(x) == tuple(y) for x, y in zip(a["shapes"], b["shapes"])))


_NAME_IDS: dict[int, tuple[list[str], np.ndarray]] = {}
"""Spec ids of a blob's names, by the names list's identity (kept with it): the blobs a
replan makes are read by the next one."""


def _name_ids(names: list[str], index: dict[str, int]) -> np.ndarray:
    kept = _NAME_IDS.get(id(names))
    if kept is not None and kept[0] is names:
        return kept[1]
    ids = np.fromiter((index[n] for n in names), np.int64, len(names))
    _remember(names, ids)
    return ids


def _remember(names: list[str], ids: np.ndarray) -> None:
    if len(_NAME_IDS) >= 128:
        _NAME_IDS.pop(next(iter(_NAME_IDS)))
    _NAME_IDS[id(names)] = (names, ids)


def _patched(blob: dict[str, Any], rp: RankPlan, slots: list[Slots], old: Placement,
             new: Placement, spec: ModelSpec, ids: ExpertIds) -> dict[str, Any]:
    t = Table.from_msgpack(PIECE_COLUMNS, blob["pieces"], f"tensors/{rp.rank}")
    cols = {name: t[name] for name, _ in PIECE_COLUMNS}
    gid = _name_ids(blob["names"], ids.index)[cols["tensor"]]
    slot_of = np.full(len(rp.regions), -1, np.int64)  # region -> its index in `slots`
    slot_of[[s.region for s in slots]] = np.arange(len(slots))
    region = cols["region"].astype(np.int64)
    k = slot_of[np.where(region < len(slot_of), region, 0)]
    rows = np.flatnonzero((k >= 0) & (region < len(slot_of)))
    k = k[rows]
    moe, first = (np.array([getattr(s, f) for s in slots], np.int64) for f in ("moe", "first"))
    numel = np.array([math.prod(rp.regions[s.region].shape[1:]) for s in slots], np.int64)
    g = first[k] + cols["start"][rows] // numel[k]
    layer = moe[k]
    if (ids.expert[gid[rows]] != old.table[layer, g]).any():
        raise NotIncremental(f"replan: target rank {rp.rank}'s tensors do not match the "
                             "plan's placement; the plan is corrupt: recompile it")
    gid[rows] = ids.ids[layer, new.table[layer, g], ids.weight[gid[rows]]]
    uniq, local = np.unique(gid, return_inverse=True)
    cols["tensor"] = local.reshape(-1)
    names, shapes = _names_shapes(spec)
    listed = uniq.tolist()
    out = encode_rank_tensors(cols, np.frombuffer(blob["buffer"], np.uint8),
                              [names[i] for i in listed], [shapes[i] for i in listed])
    _remember(out["names"], uniq)
    return out


_SPEC_NAMES: list[tuple[ModelSpec, tuple[list[str], list[tuple[int, ...]]]]] = []


def _names_shapes(spec: ModelSpec) -> tuple[list[str], list[tuple[int, ...]]]:
    """Every spec tensor's name and shape, by id (the last few specs' kept)."""
    for kept, lists in _SPEC_NAMES:
        if kept is spec:
            return lists
    lists = ([t.name for t in spec.tensors], [t.shape for t in spec.tensors])
    _SPEC_NAMES.append((spec, lists))
    del _SPEC_NAMES[:-2]
    return lists
