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
  the same table positions when the group's batches keep their sizes, else the source
  rank's writes and batches are laid out again as `schedule` lays them;
- the explain rows of the moved slots' target tensors, the target ranks' `tensors/<rank>`
  blobs, the header's placement and its fingerprint (`planner/placement.py`).

A source where that does not hold (experts on EP ranks: a moved expert's bytes come from
another rank, so its writes join another rank's batches and the schedule changes) is refused
with one line (`NotIncremental`): compile the new placement in full.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np

from planner.layouts.vllm_rank import eplb_layers
from planner.passes.schedule import MAX_BATCH_WRITES
from planner.placement import ExpertIds
from planner.spec import ModelSpec
from schemas import placement as placement_mod
from schemas.errors import UserError
from schemas.header import PlanHeader
from schemas.placement import Placement
from schemas.plan import BATCH_COLUMNS, EXPLAIN_COLUMNS, STAGING, WRITE_COLUMNS, Plan, RankPlan
from schemas.table import Table
from schemas.tensors import PIECE_COLUMNS, encode_rank_tensors

_SLOT_TENSOR = re.compile(
    r"^model\.layers\.(\d+)\..*experts\.(?:routed_experts\.)?(w13|w2)_weight$")


class NotIncremental(UserError):
    """This plan cannot be edited for the new placement; compile it in full."""


@dataclasses.dataclass(frozen=True)
class _Slots:
    """One target region of stacked experts (w13 or w2 of one MoE layer on one rank)."""

    rank: int
    region: int
    moe: int
    first: int
    """Global physical slot of its local slot 0."""
    count: int
    slot_bytes: int


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
    slots = list(_slot_regions(plan, h, eplb_layers(d)))
    ep = old.physical // max(1, slots[0].count) if slots else 1
    new.check(d.num_experts, len(eplb_layers(d)), ep)
    moved = old.moved(new)
    if len(moved) == 0:
        return plan
    ids = ExpertIds.of(spec)
    moved_set = {(int(l_), int(s)) for l_, s in moved}
    hit = [s for s in slots if any((s.moe, g) in moved_set
                                   for g in range(s.first, s.first + s.count))]
    src = _SourceTensors(plan, h.sources, spec, ids)
    ranks = list(plan.ranks)
    for r in range(h.sources):
        ranks[r] = _replan_source(plan.ranks[r], hit, old, new, src, ids,
                                  h.options.max_write_bytes, h.sources, h.targets)
    _no_copies(plan, hit, h.sources)
    explain = _explain(plan.explain, hit, old, new, src, ids)
    blobs = _target_blobs(plan, hit, old, new, spec, ids, h.sources)
    header = dataclasses.replace(h, placement=new,
                                 target=dataclasses.replace(h.target, placement=new),
                                 fingerprint=placement_mod.fingerprint(h.placement_base, new))
    return dataclasses.replace(plan, header=header, ranks=tuple(ranks), explain=explain,
                               extra_blobs=blobs)


def _slot_regions(plan: Plan, h: PlanHeader, moe_layers: tuple[int, ...]) -> Iterator[_Slots]:
    moe = {layer: i for i, layer in enumerate(moe_layers)}
    for rp in plan.ranks[h.sources:]:
        ep = _ep_rank(h, rp.rank)
        for i, reg in enumerate(rp.regions):
            m = _SLOT_TENSOR.match(reg.name)
            if m is None or int(m[1]) not in moe or len(reg.shape) != 3 or not reg.shape[0]:
                continue
            n = reg.shape[0]
            yield _Slots(rp.rank, i, moe[int(m[1])], ep * n, n, reg.nbytes // n)


def _ep_rank(h: PlanHeader, rank: int) -> int:
    ident = h.identities[rank] if h.identities else {}
    if h.target is not None and h.target.engine == "sglang":
        return int(ident.get("tp", 0))
    return int(ident.get("ep", 0))


class _SourceTensors:
    """Per source rank, from its `tensors/<rank>` blob: the region holding each logical
    tensor (-1: none) and that piece's geometry, for the expert tensors."""

    def __init__(self, plan: Plan, sources: int, spec: ModelSpec, ids: ExpertIds) -> None:
        self.blobs = dict(plan.extra_blobs)
        self.plan, self.spec, self.ids = plan, spec, ids
        self.index = {t.name: i for i, t in enumerate(spec.tensors)}
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def of(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(region of each spec tensor id, geometry rows `[n, 7]` of its piece)."""
        if rank not in self._cache:
            blob = _resolve(self.blobs, rank)
            t = Table.from_msgpack(PIECE_COLUMNS, blob["pieces"], f"tensors/{rank}")
            gid = np.array([self.index[n] for n in blob["names"]], np.int64)[t["tensor"]]
            n = len(self.spec.tensors)
            region = np.full(n, -1, np.int64)
            expert = self.ids.layer[gid] >= 0
            g, reg = gid[expert], t["region"][expert].astype(np.int64)
            if len(np.unique(g)) != len(g) or len(np.unique(reg)) != len(reg):
                raise NotIncremental(f"replan: source rank {rank} holds an expert in several "
                                     "pieces or several experts in one tensor; compile the "
                                     "new placement in full")
            region[g] = reg
            geom = np.zeros((n, 7), np.int64)
            geom[g] = np.stack([t[c][expert] for c in ("off0", "off1", "size0", "size1",
                                                         "start", "stride0", "stride1")], 1)
            self._cache[rank] = (region, geom)
        return self._cache[rank]

    def region_of(self, rank: int, gid: np.ndarray) -> np.ndarray:
        return self.of(rank)[0][gid]


def _resolve(blobs: dict[str, Any], rank: int) -> dict[str, Any]:
    blob = blobs[f"tensors/{rank}"]
    if "same_as" in blob:
        blob = blobs[f"tensors/{blob['same_as']}"]
    return blob


def _replan_source(rp: RankPlan, hit: list[_Slots], old: Placement, new: Placement,
                   src: _SourceTensors, ids: ExpertIds, max_write_bytes: int, sources: int,
                   targets: int) -> RankPlan:
    w = rp.writes
    if not len(w) or not hit:
        return rp
    dst_rank, dst_region = w["dst_rank"], w["dst_region"]
    by_key = {(s.rank, s.region): s for s in hit}
    keys = np.unique(dst_rank.astype(np.int64) << 32 | dst_region.astype(np.int64))
    mine = [by_key[(int(k >> 32), int(k & 0xFFFFFFFF))] for k in keys.tolist()
            if (int(k >> 32), int(k & 0xFFFFFFFF)) in by_key]
    if not mine:
        return rp
    src_region = w["src_region"].astype(np.int64)
    region_of, geom = src.of(rp.rank)
    gid_of_region = np.full(max(len(rp.regions), 1), -1, np.int64)
    held = np.flatnonzero(region_of >= 0)
    gid_of_region[region_of[held]] = held
    new_region = src_region.copy()
    touched = np.zeros(len(w), bool)
    for s in mine:
        rows = np.flatnonzero((dst_rank == s.rank) & (dst_region == s.region))
        local = w["dst_offset"][rows] // s.slot_bytes
        g = s.first + local
        was, now = old.table[s.moe, g], new.table[s.moe, g]
        move = was != now
        rows, was, now = rows[move], was[move], now[move]
        if not len(rows):
            continue
        if (src_region[rows] >= len(gid_of_region) - 1).any() and rp.regions[-1].name == STAGING:
            raise NotIncremental(f"replan: source rank {rp.rank} sends MoE layer {s.moe}'s "
                                 "slots through staging (packed or gathered); compile the new "
                                 "placement in full")
        gid = gid_of_region[src_region[rows]]
        if (gid < 0).any() or (ids.expert[gid] != was).any() or (ids.layer[gid] != s.moe).any():
            raise NotIncremental(f"replan: source rank {rp.rank} writes MoE layer {s.moe}'s "
                                 "slots from tensors other than the placement's experts; "
                                 "compile the new placement in full")
        to = ids.ids[s.moe, now, ids.weight[gid]]
        reg = region_of[to]
        if (reg < 0).any() or (geom[to] != geom[gid]).any():
            raise NotIncremental(f"replan: source rank {rp.rank} does not hold every expert of "
                                 f"MoE layer {s.moe} with the same cut (experts placed on EP "
                                 "ranks?); compile the new placement in full")
        new_region[rows] = reg
        touched[rows] = True
    if not touched.any():
        return rp
    return _reorder(rp, new_region, touched, max_write_bytes, sources, targets)


def _stage_of_rows(rp: RankPlan) -> np.ndarray:
    b = rp.batches
    stage = np.empty(len(rp.writes), np.int64)
    for st, a, z in zip(b["stage"].tolist(), b["start"].tolist(), b["stop"].tolist()):
        stage[a:z] = st
    return stage


def _rounds(nbytes: np.ndarray, max_write_bytes: int) -> np.ndarray:
    """`schedule`'s round of each write of one (source, stage, target) group, in order."""
    before = np.cumsum(nbytes) - nbytes
    return np.maximum(before // max_write_bytes, np.arange(len(nbytes)) // MAX_BATCH_WRITES)


def _reorder(rp: RankPlan, src_region: np.ndarray, touched: np.ndarray,
             max_write_bytes: int, sources: int, targets: int) -> RankPlan:
    """`rp` with `src_region`, each (stage, target) group holding a touched write put back
    in the compiler's order: in place when the group's rounds are unchanged, else the whole
    rank laid out again."""
    w = rp.writes
    cols = {name: w[name].astype(np.int64) for name, _ in WRITE_COLUMNS}
    cols["src_region"] = src_region
    stage = _stage_of_rows(rp)
    gkey = stage << 32 | cols["dst_rank"]
    order = np.argsort(gkey, kind="stable")  # table order kept within each group
    cut = np.flatnonzero(np.diff(gkey[order])) + 1
    groups = np.split(order, cut)
    perm = np.arange(len(w))
    for rows in groups:
        if not touched[rows].any():
            continue
        o = np.lexsort((cols["dst_offset"][rows], cols["src_offset"][rows],
                        cols["dst_region"][rows], cols["src_region"][rows]))
        if not np.array_equal(_rounds(cols["nbytes"][rows][o], max_write_bytes),
                              _rounds(cols["nbytes"][rows], max_write_bytes)):
            return _relayout(rp, cols, stage, max_write_bytes, sources, targets)
        perm[rows] = rows[o]
    writes = Table.build(WRITE_COLUMNS, **{name: cols[name][perm] for name, _ in WRITE_COLUMNS})
    return dataclasses.replace(rp, writes=writes)


def _relayout(rp: RankPlan, cols: dict[str, np.ndarray], stage: np.ndarray,
              max_write_bytes: int, sources: int, targets: int) -> RankPlan:
    """One source rank's writes and batches as `coalesce` and `schedule` order them: groups
    (stage, target) in the compiler's order, rounds, then (stage, round, rotation)."""
    nic_of = {}
    b = rp.batches
    for st, nic, a in zip(b["stage"].tolist(), b["nic"].tolist(), b["start"].tolist()):
        nic_of[(st, int(cols["dst_rank"][a]))] = nic
    o = np.lexsort((cols["dst_offset"], cols["src_offset"], cols["dst_region"],
                    cols["src_region"], cols["dst_rank"], stage))
    st, dst, nb = stage[o], cols["dst_rank"][o], cols["nbytes"][o]
    start = np.flatnonzero(np.concatenate([[True], (st[1:] != st[:-1]) | (dst[1:] != dst[:-1])]))
    rnd = np.concatenate([_rounds(part, max_write_bytes) for part in np.split(nb, start[1:])])
    rot = (dst - sources + rp.rank) % max(targets, 1)
    final = o[np.lexsort((rot, rnd, st))]
    rnd_at = np.empty(len(o), np.int64)
    rnd_at[o] = rnd
    fs, fd, fr = stage[final], cols["dst_rank"][final], rnd_at[final]
    new_batch = np.concatenate([[True], (fs[1:] != fs[:-1]) | (fd[1:] != fd[:-1])
                                | (fr[1:] != fr[:-1])])
    bstart = np.flatnonzero(new_batch)
    bstop = np.append(bstart[1:], len(final))
    batches = Table.build(BATCH_COLUMNS, stage=fs[bstart],
                          nic=[nic_of[(int(s), int(t))] for s, t in zip(fs[bstart], fd[bstart])],
                          start=bstart, stop=bstop)
    writes = Table.build(WRITE_COLUMNS, **{name: cols[name][final] for name, _ in WRITE_COLUMNS})
    return dataclasses.replace(rp, writes=writes, batches=batches)


def _no_copies(plan: Plan, hit: list[_Slots], sources: int) -> None:
    """No unpack writes a moved slot's target tensor (its bytes come by direct writes)."""
    for s in hit:
        c = plan.ranks[s.rank].copies
        if len(c) and (c["dst_region"] == s.region).any():
            raise NotIncremental(f"replan: target rank {s.rank - sources} unpacks into a "
                                 f"stacked expert tensor of MoE layer {s.moe}; compile the "
                                 "new placement in full")


def _explain(table: Table, hit: list[_Slots], old: Placement, new: Placement,
             src: _SourceTensors, ids: ExpertIds) -> Table:
    """The explain table with the rows into each hit target tensor made again from the new
    slot contents: per source row, a slot's share times the slots holding that expert."""
    if not len(table):
        return table
    col = {name: table[name].astype(np.int64) for name, _ in EXPLAIN_COLUMNS}
    drop = np.zeros(len(table), bool)
    add: list[np.ndarray] = []
    for s in hit:
        rows = np.flatnonzero((col["dst_rank"] == s.rank) & (col["dst_region"] == s.region))
        drop[rows] = True
        before = np.bincount(old.table[s.moe, s.first:s.first + s.count],
                             minlength=ids.ids.shape[1])
        after = np.bincount(new.table[s.moe, s.first:s.first + s.count],
                            minlength=ids.ids.shape[1])
        t = col["tensor"][rows]
        e, wt = ids.expert[t], ids.weight[t]
        if (e < 0).any() or (ids.layer[t] != s.moe).any():
            raise NotIncremental(f"replan: target rank {s.rank}'s stacked experts of MoE layer "
                                 f"{s.moe} hold other tensors; compile the new placement in full")
        n = before[e]
        if ((col["nbytes"][rows] % n) | (col["boxes"][rows] % n)).any():
            raise NotIncremental("replan: the slots of one expert are fed unevenly; compile "
                                 "the new placement in full")
        e0 = e[0]
        tmpl = rows[e == e0]
        per_bytes = col["nbytes"][tmpl] // before[e0]
        per_boxes = col["boxes"][tmpl] // before[e0]
        s_rank, w0 = col["src_rank"][tmpl], ids.weight[col["tensor"][tmpl]]
        for ex in np.flatnonzero(after).tolist():
            gid = ids.ids[s.moe, ex, w0]
            reg = np.array([src.region_of(int(r), np.array([g]))[0]
                            for r, g in zip(s_rank.tolist(), gid.tolist())], np.int64)
            add.append(np.stack([gid, s_rank, reg, np.full(len(gid), s.rank),
                                 np.full(len(gid), s.region), per_bytes * after[ex],
                                 per_boxes * after[ex]], 1))
        del wt
    extra = np.concatenate(add) if add else np.zeros((0, 7), np.int64)
    affected = np.union1d(np.unique(col["tensor"][drop]), np.unique(extra[:, 0]))
    keep_mask = ~np.isin(col["tensor"], affected)
    moved_rows = np.flatnonzero(~keep_mask & ~drop)
    block = np.concatenate([np.stack([col[n][moved_rows] for n, _ in EXPLAIN_COLUMNS], 1),
                            extra])
    block = block[np.lexsort(block[:, 4::-1].T)]
    kept = {n: col[n][keep_mask] for n, _ in EXPLAIN_COLUMNS}
    at = np.searchsorted(kept["tensor"], block[:, 0])
    out = {n: np.insert(kept[n], at, block[:, i]) for i, (n, _) in enumerate(EXPLAIN_COLUMNS)}
    return Table.build(EXPLAIN_COLUMNS, **out)


def _target_blobs(plan: Plan, hit: list[_Slots], old: Placement, new: Placement,
                  spec: ModelSpec, ids: ExpertIds, sources: int) -> tuple[tuple[str, Any], ...]:
    """Every `tensors/<rank>` blob, the hit target ranks' made again (names and pieces of
    the moved slots), target blobs equal to an earlier rank's as `same_as` it."""
    blobs = dict(plan.extra_blobs)
    index = {t.name: i for i, t in enumerate(spec.tensors)}
    by_rank: dict[int, list[_Slots]] = {}
    for s in hit:
        by_rank.setdefault(s.rank, []).append(s)
    content: dict[int, dict[str, Any]] = {}
    for r in range(sources, len(plan.ranks)):
        blob = _resolve(blobs, r)
        if r in by_rank:
            blob = _patched(blob, plan.ranks[r], by_rank[r], old, new, spec, ids, index)
        content[r] = blob
    first: dict[bytes, int] = {}
    for name, _ in plan.extra_blobs:
        r = int(name.split("/")[1])
        if r < sources:
            first.setdefault(msgpack.packb(_resolve(blobs, r), use_bin_type=True), r)
    out = []
    for name, blob in plan.extra_blobs:
        r = int(name.split("/")[1])
        if r >= sources:
            c = content[r]
            same = first.setdefault(msgpack.packb(c, use_bin_type=True), r)
            blob = c if same == r else {"same_as": same}
        out.append((name, blob))
    return tuple(out)


def _patched(blob: dict[str, Any], rp: RankPlan, slots: list[_Slots], old: Placement,
             new: Placement, spec: ModelSpec, ids: ExpertIds, index: dict[str, int]
             ) -> dict[str, Any]:
    t = Table.from_msgpack(PIECE_COLUMNS, blob["pieces"], f"tensors/{rp.rank}")
    cols = {name: t[name].copy() for name, _ in PIECE_COLUMNS}
    gid = np.array([index[n] for n in blob["names"]], np.int64)[cols["tensor"]]
    for s in slots:
        rows = np.flatnonzero(cols["region"] == s.region)
        numel = int(np.prod(rp.regions[s.region].shape[1:]))
        g = s.first + cols["start"][rows] // numel
        now = new.table[s.moe, g]
        if (ids.expert[gid[rows]] != old.table[s.moe, g]).any():
            raise NotIncremental(f"replan: target rank {rp.rank}'s tensors do not match the "
                                 "plan's placement; the plan is corrupt: recompile it")
        gid[rows] = ids.ids[s.moe, now, ids.weight[gid[rows]]]
    uniq, local = np.unique(gid, return_inverse=True)
    cols["tensor"] = local.reshape(-1)
    logical = [spec.tensors[i] for i in uniq.tolist()]
    return encode_rank_tensors(cols, np.frombuffer(blob["buffer"], np.uint8),
                               [x.name for x in logical], [x.shape for x in logical])
