"""Replan for a new expert placement: the previous plan edited where experts moved.

When an engine's EPLB moves experts (`schemas/placement.py`), only the writes into the moved
physical slots change: the target tensors, their regions and sizes stay (the slot count is
fixed), so every rank keeps its registered memory. `replan(plan, spec, new)` gives the plan a
full compile of the new placement gives, byte for byte, by editing the previous one:

- each write into a moved slot reads the new logical expert's source tensor instead of the
  old one's (same source rank, same offsets and length: the source holds every expert of a
  layer with the same cut, one piece per tensor, on one holder, and no pack, unpack or quant
  touches an expert); the writes of each (source, stage, target) group are put back in the
  order `coalesce` and `schedule` give (source region, target region, source offset), in
  the same table positions (the group's batches keep their cuts: else `NotIncremental`);
- the explain rows of the moved slots' target tensors, the target ranks' `tensors/<rank>`
  blobs, the header's placement and its fingerprint (`planner/placement.py`).

A source where that does not hold (experts on EP ranks: a moved expert's bytes come from
another rank, so its writes join another rank's batches and the schedule changes) is refused
with one line (`NotIncremental`): compile the new placement in full.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from planner.errors import NotIncremental
from planner.layouts.vllm_rank import eplb_layers
from planner.passes.schedule import MAX_BATCH_WRITES
from planner.placement import ExpertIds
from planner.replan_explain import explain
from planner.replan_tables import (
    Hits,
    Slots,
    SourceTensors,
    slot_regions,
    target_blobs,
)
from planner.spec import ModelSpec
from schemas import placement as placement_mod
from schemas.placement import Placement
from schemas.plan import STAGING, WRITE_COLUMNS, Plan, RankPlan
from schemas.table import Table


def replan(plan: Plan, spec: ModelSpec, new: Placement) -> Plan:
    """The plan for placement `new`, from `plan` (compiled, or replanned, for another
    placement of the same slot count); raises `NotIncremental` (one line) when only a full
    compile can give it, `ConfigError` when `new` does not fit the model or the EP size."""
    h = plan.header
    old = h.placement
    if old is None or h.target is None:
        raise NotIncremental("replan: the plan records no expert placement (target.placement "
                             "was not set); compile it with one")
    d = spec.dims
    slots = slot_regions(plan, h, eplb_layers(d))
    ep = old.physical // max(1, slots[0].count) if slots else 1
    new.check(d.num_experts, len(eplb_layers(d)), ep)
    moved = old.moved(new)
    if len(moved) == 0:
        return plan
    ids = ExpertIds.of(spec)
    change = np.zeros(old.table.shape, bool)
    change[moved[:, 0], moved[:, 1]] = True
    run = np.concatenate([np.zeros((len(change), 1), np.int64), np.cumsum(change, 1)], 1)
    moe, first, count = (np.array([getattr(s, f) for s in slots], np.int64)
                         for f in ("moe", "first", "count"))
    any_moved = run[moe, first + count] > run[moe, first]  # a slot of the tensor moved
    hit = [slots[i] for i in np.flatnonzero(any_moved).tolist()]
    src, hits = SourceTensors(plan, h.sources, spec, ids), Hits(hit)
    ranks = list(plan.ranks)
    for r in range(h.sources):
        ranks[r] = _replan_source(plan.ranks[r], hits, old, new, src, ids,
                                  h.options.max_write_bytes, h.sources, h.targets)
    _no_copies(plan, hit, h.sources)
    table = explain(plan.explain, slots, old, new, src, ids, h.sources)
    blobs = target_blobs(plan, hit, old, new, spec, ids, h.sources)
    header = dataclasses.replace(h, placement=new,
                                 target=dataclasses.replace(h.target, placement=new),
                                 fingerprint=placement_mod.fingerprint(h.placement_base, new))
    return dataclasses.replace(plan, header=header, ranks=tuple(ranks), explain=table,
                               extra_blobs=blobs)


def _replan_source(rp: RankPlan, hits: Hits, old: Placement, new: Placement,
                   src: SourceTensors, ids: ExpertIds, max_write_bytes: int, sources: int,
                   targets: int) -> RankPlan:
    w = rp.writes
    if not len(w) or not len(hits.key):
        return rp
    rows, h = hits.find(w["dst_rank"], w["dst_region"])
    g = hits.first[h] + w["dst_offset"][rows] // hits.slot_bytes[h]
    layer = hits.moe[h]
    was, now = old.table[layer, g], new.table[layer, g]
    move = was != now
    rows, was, now, layer = rows[move], was[move], now[move], layer[move]
    if not len(rows):
        return rp
    src_region = w["src_region"].astype(np.int64)
    if rp.regions[-1].name == STAGING and (src_region[rows] == len(rp.regions) - 1).any():
        raise NotIncremental(f"replan: source rank {rp.rank} sends moved expert slots through "
                             "staging (packed or gathered); compile the new placement in full")
    region_of, gid_of_region = src.of(rp.rank)
    gid = gid_of_region[src_region[rows]]
    if (gid < 0).any() or (ids.expert[gid] != was).any() or (ids.layer[gid] != layer).any():
        raise NotIncremental(f"replan: source rank {rp.rank} writes expert slots from tensors "
                             "other than the placement's experts; compile the new placement "
                             "in full")
    to = ids.ids[layer, now, ids.weight[gid]]
    reg = region_of[to]
    if (reg < 0).any() or (src.geometry(rp.rank, to) != src.geometry(rp.rank, gid)).any():
        raise NotIncremental(f"replan: source rank {rp.rank} does not hold every expert of a "
                             "MoE layer with the same cut (experts placed on EP ranks?); "
                             "compile the new placement in full")
    src_region[rows] = reg
    touched = np.zeros(len(w), bool)
    touched[rows] = True
    return _reorder(rp, src_region, touched, max_write_bytes, sources, targets)


def _stage_of_rows(rp: RankPlan) -> np.ndarray:
    b = rp.batches
    return np.repeat(b["stage"].astype(np.int64), b["stop"] - b["start"])


def _rounds(nbytes: np.ndarray, first: np.ndarray, max_write_bytes: int) -> np.ndarray:
    """`schedule`'s round of each write, for writes laid out group after group (`first`:
    whether a write begins its (source, stage, target) group), in order."""
    n = len(nbytes)
    start = np.flatnonzero(first)
    size = np.diff(np.append(start, n))
    cs = np.cumsum(nbytes)
    base = np.repeat(cs[start] - nbytes[start], size)
    pos = np.arange(n) - np.repeat(start, size)
    return np.maximum((cs - nbytes - base) // max_write_bytes, pos // MAX_BATCH_WRITES)


def _reorder(rp: RankPlan, src_region: np.ndarray, touched: np.ndarray,
             max_write_bytes: int, sources: int, targets: int) -> RankPlan:
    """`rp` with `src_region`, each (stage, target) group holding a touched write put back
    in the compiler's order, in the same table positions: its rounds (`schedule`'s batch
    cuts) unchanged, else `NotIncremental`.

    The order is one int64 key where the group and the four sort columns fit in it: the
    untouched writes of a touched group are in it already (in table order), so only the
    touched ones are sorted and merged in; else (or where the plan is not in that order)
    each touched group is sorted whole."""
    w = rp.writes
    group = _stage_of_rows(rp) * (sources + targets) + w["dst_rank"]
    hit = np.zeros(int(group.max()) + 1, bool)
    hit[group[touched]] = True
    at = np.flatnonzero(hit[group])  # the touched groups' positions
    g_at = group[at]
    small = np.uint16 if g_at.max() < 1 << 16 else np.int64
    at = at[np.argsort(g_at.astype(small), kind="stable")]  # group by group, in order
    key = _sort_key(group[at], src_region[at], *(w[c][at] for c in (
        "dst_region", "src_offset", "dst_offset")))  # of each position in `at`
    if key is None:
        return _reorder_sorted(rp, src_region, touched, max_write_bytes, sources)
    t_at = touched[at]
    keep, k_keep = at[~t_at], key[~t_at]
    if (np.diff(k_keep) <= 0).any():  # not in the compiler's order, or equal keys
        return _reorder_sorted(rp, src_region, touched, max_write_bytes, sources)
    mine = np.flatnonzero(t_at)
    mine = mine[np.argsort(key[mine])]
    moved, k_moved = at[mine], key[mine]
    ins = np.searchsorted(k_keep, k_moved)
    tie = (np.diff(k_moved) == 0).any() or (
        len(k_keep) > 0 and (k_keep[np.minimum(ins, len(k_keep) - 1)] == k_moved).any())
    if tie:  # two writes of one source and target bytes: the table order decides
        return _reorder_sorted(rp, src_region, touched, max_write_bytes, sources)
    got = np.insert(keep, ins, moved)  # the rows in key order: what each position takes
    return _placed(rp, src_region, at, got, group, max_write_bytes, sources)


def _sort_key(*cols: np.ndarray) -> np.ndarray | None:
    """(group, src_region, dst_region, src_offset, dst_offset) of some writes as one int64
    per write, in that order, or None where it does not fit in 63 bits."""
    cols = tuple(c.astype(np.int64, copy=False) for c in cols)
    if not len(cols[0]) or min(int(c.min()) for c in cols) < 0:
        return None if len(cols[0]) else np.zeros(0, np.int64)
    bits = [int(c.max()).bit_length() for c in cols]
    if sum(bits) > 63:
        return None
    key = cols[0].copy()
    for c, b in zip(cols[1:], bits[1:]):
        key <<= b
        key |= c
    return key


def _placed(rp: RankPlan, src_region: np.ndarray, at: np.ndarray, got: np.ndarray,
            group: np.ndarray, max_write_bytes: int, sources: int) -> RankPlan:
    """`rp`'s writes with row `got[i]` at position `at[i]` (every group's positions in
    table order, group after group; `got` the same rows in the compiler's order), the
    rounds checked where a write of another size took a position."""
    w = rp.writes
    nbytes = w["nbytes"]
    change = at != got
    if (nbytes[at[change]] != nbytes[got[change]]).any():
        first = np.ones(len(at), bool)
        first[1:] = group[at[1:]] != group[at[:-1]]
        _same_cuts(rp, at, got, first, max_write_bytes, sources)
    at, got = at[change], got[change]
    cols = {}
    for name, dt in WRITE_COLUMNS:
        col = src_region if name == "src_region" else w[name]
        if len(at) or name == "src_region":
            c = np.array(col, dtype=dt)
            c[at] = col[got]
            col = c
        cols[name] = col
    return dataclasses.replace(rp, writes=Table.build(WRITE_COLUMNS, **cols))


def _same_cuts(rp: RankPlan, at: np.ndarray, got: np.ndarray, first: np.ndarray,
               max_write_bytes: int, sources: int) -> None:
    """`NotIncremental` unless the writes `got` put at positions `at` (`first`: where a
    (stage, target) group starts) keep `schedule`'s batch cuts (`_rounds`)."""
    nbytes = rp.writes["nbytes"]
    bad = _rounds(nbytes[got], first, max_write_bytes) != _rounds(nbytes[at], first,
                                                                  max_write_bytes)
    if bad.any():
        dst = int(rp.writes["dst_rank"][at[np.argmax(bad)]])
        raise NotIncremental(f"replan: source rank {rp.rank}'s batches to target rank "
                             f"{dst - sources} change their cut (writes of unequal sizes "
                             "reordered); compile the new placement in full")


def _reorder_sorted(rp: RankPlan, src_region: np.ndarray, touched: np.ndarray,
                    max_write_bytes: int, sources: int) -> RankPlan:
    """`rp` with `src_region`, each (stage, target) group holding a touched write put back
    in the compiler's order, in the same table positions: its rounds (`schedule`'s batch
    cuts) unchanged, else `NotIncremental`."""
    w = rp.writes
    gkey = _stage_of_rows(rp) << 32 | w["dst_rank"].astype(np.int64)
    rows = np.flatnonzero(np.isin(gkey, np.unique(gkey[touched])))  # table order
    key = gkey[rows]
    at = rows[np.argsort(key, kind="stable")]  # each group's positions, group by group
    got = rows[np.lexsort((w["dst_offset"][rows], w["src_offset"][rows],
                           w["dst_region"][rows], src_region[rows], key))]
    first = np.ones(len(at), bool)
    first[1:] = gkey[at[1:]] != gkey[at[:-1]]
    _same_cuts(rp, at, got, first, max_write_bytes, sources)
    cols = {}
    for name, _ in WRITE_COLUMNS:
        c = (src_region if name == "src_region" else w[name]).copy()
        c[at] = c[got]
        cols[name] = c
    writes = Table.build(WRITE_COLUMNS, **cols)
    return dataclasses.replace(rp, writes=writes)


def _no_copies(plan: Plan, hit: list[Slots], sources: int) -> None:
    """No unpack writes a moved slot's target tensor (its bytes come by direct writes)."""
    for s in hit:
        c = plan.ranks[s.rank].copies
        if len(c) and (c["dst_region"] == s.region).any():
            raise NotIncremental(f"replan: target rank {s.rank - sources} unpacks into a "
                                 f"stacked expert tensor of MoE layer {s.moe}; compile the "
                                 "new placement in full")

