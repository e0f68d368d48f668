"""The replan's indexes and its rewrite of the target blobs (`planner/replan.py` edits the
writes, `planner/replan_explain.py` the explain rows): the hit target tensors (`Slots`,
`Hits`), each source rank's expert tensors (`SourceTensors`) and the target ranks'
`tensors/<rank>` blobs (`target_blobs`), as a full compile gives them."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from planner.errors import NotIncremental
from planner.placement import ExpertIds, ep_rank
from planner.spec import ModelSpec
from schemas.header import PlanHeader
from schemas.placement import Placement
from schemas.plan import Plan, RankPlan
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
    tensor (-1: none) and, asked for, whether two expert tensors' pieces sit alike in
    their tensors (only for the pairs asked: a replan asks for the moved writes')."""

    _GEOMETRY = ("off0", "off1", "size0", "size1", "start", "stride0", "stride1")
    _MANY = 0.25
    """Pairs asked for (per spec tensor) from which the rank's experts are first checked
    alike (once; then no pair needs comparing) rather than each pair compared."""

    def __init__(self, plan: Plan, sources: int, spec: ModelSpec, ids: ExpertIds) -> None:
        self.blobs = dict(plan.extra_blobs)
        self.plan, self.spec, self.ids = plan, spec, ids
        self.index = ids.index
        self._cache: dict[int, tuple[np.ndarray, np.ndarray, Table, list[bool], np.ndarray]] = {}

    def of(self, rank: int) -> np.ndarray:
        """The region of each spec tensor id (-1: none), then -1 (at index -1: the region
        of `ExpertIds.of_packed`'s -1, no tensor)."""
        return self._of(rank)[0]

    def packed(self, rank: int) -> np.ndarray:
        """The packed id (`ExpertIds.packed`) of each region's expert tensor (-1: none)."""
        return self._of(rank)[4]

    def alike(self, rank: int, pairs: int) -> bool:
        """Whether `same_geometry` of `pairs` pairs of `rank`'s expert tensors is true
        without comparing them: many pairs, and every expert of each (MoE layer, weight)
        sits alike in its tensor."""
        _, row, t, alike = self._of(rank)[:4]
        return pairs > self._MANY * len(self.ids.layer) and self._alike(row, t, alike)

    def same_geometry(self, rank: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Whether the piece of expert tensor `a[i]` sits in its tensor as `b[i]`'s does
        (equal offsets, sizes, start and strides), both held by `rank` and of one MoE
        layer and weight. Few pairs: their pieces compared; many: whether every expert of
        each (MoE layer, weight) has one geometry (read once per rank), else compared."""
        _, row, t, alike = self._of(rank)[:4]
        if len(a) > self._MANY * len(self.ids.layer) and self._alike(row, t, alike):
            return np.ones(len(a), bool)
        ra, rb = row[a], row[b]
        out = (ra >= 0) & (rb >= 0)
        for c in self._GEOMETRY:
            col = t[c]
            out &= col[ra] == col[rb]
        return out

    def _alike(self, row: np.ndarray, t: Table, kept: list[bool]) -> bool:
        """Whether every expert of each (MoE layer, weight) sits alike in its tensor (`row`,
        `t`: a rank's pieces; `kept`: the answer, once known, kept with them)."""
        if not kept:
            ids = self.ids.ids
            grid = np.where(ids >= 0, row[np.maximum(ids, 0)], -1)  # -> piece
            alike = bool((grid >= 0).all())
            for c in self._GEOMETRY if alike else ():
                v = t[c][grid]
                alike = alike and bool((v == v[:, :1]).all())
            kept.append(alike)
        return kept[0]

    def _of(self, rank: int) -> tuple[np.ndarray, np.ndarray, Table, list[bool], np.ndarray]:
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
            seen = np.zeros(self.ids.ids.shape[0] * self.ids.ids.shape[1], bool)
            seen[self.ids.layer[g] * self.ids.ids.shape[1] + self.ids.expert[g]] = True
            held = int(np.count_nonzero(seen))
            if held < len(seen):
                raise NotIncremental(
                    f"replan: source rank {rank} holds {held} of the "
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
            region = np.full(n + 1, -1, np.int32)  # (regions and pieces: int32, as the
            region[g] = reg  # tables'; one more -1 at the end: `of`)
            row = np.full(n, -1, np.int32)  # the piece (row of `t`) of each expert tensor
            row[g] = expert
            packed_of_region = np.full(nreg, -1, np.int32)
            inside = reg < nreg
            packed_of_region[reg[inside]] = self.ids.packed[g[inside]]
            self._cache[rank] = (region, row, t, [], packed_of_region)
            _SOURCES_KEPT.append((blob, self.spec, nreg, self._cache[rank]))
            del _SOURCES_KEPT[:-_SOURCES_KEEP]
        return self._cache[rank]


def spec_ids(names: list[str], spec: ModelSpec, index: dict[str, int]) -> np.ndarray:
    """Spec ids of a blob's names (sorted by id: `identities._blob`; all of them: arange)."""
    if len(names) == len(spec.tensors):
        return np.arange(len(names), dtype=np.int64)
    return np.fromiter(map(index.__getitem__, names), np.int64, len(names))


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
        n = int(self.rank.max()) + 1 if len(hit) else 0
        width = int(self.region.max()) + 1 if len(hit) else 0
        small = (n + 1) * (width + 1) < 1 << 31  # (then positions and hits fit in int32)
        self.index = np.full((n + 1, width + 1), -1, np.int32 if small else np.int64)
        self.index[self.rank, self.region] = np.arange(len(hit))  # (rank, region) -> hit
        # index; -1: not hit (the last row and column: every rank and region past the hit
        # ones)

    def find(self, rank: np.ndarray, region: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows whose (rank, region) is hit, the hit index of each)."""
        h = self.of(rank, region)
        rows = np.flatnonzero(h >= 0)
        return rows, h[rows]

    def of(self, rank: np.ndarray, region: np.ndarray) -> np.ndarray:
        """The hit index of each row's (rank, region) (-1: not hit)."""
        n, width = self.index.shape[0] - 1, self.index.shape[1] - 1
        dt = self.index.dtype
        at = np.minimum(rank, n, dtype=dt)
        at *= width + 1
        at += np.minimum(region, width, dtype=dt)
        return self.index.reshape(-1)[at]


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
    ids = np.fromiter(map(index.__getitem__, names), np.int64, len(names))
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
