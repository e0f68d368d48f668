"""The replan's edit of a source rank's writes (`planner/replan.py`): each write into a
moved slot reads the new expert's source tensor instead (same offsets and length), and
each (stage, target) group holding such a write is put back in the order `coalesce` and
`schedule` give (source region, target region, source offset, target offset), in the same
table positions, its batch cuts unchanged.

Where the writes sit changes from placement to placement, what they write does not: the
writes of every group holding a write into a stacked expert tensor are read once per table
(`Groups`: the groups' positions, their writes sorted by target region, source offset and
target offset, and where each write comes from: its slot, weight and piece geometry, or
its fixed source region), so a placement's order is one sort of them by (group, source
region), stable. The index is kept for the table a replan makes, with where each of its
writes now sits.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from planner.errors import NotIncremental
from planner.passes.schedule import MAX_BATCH_WRITES
from planner.placement import ExpertIds
from planner.replan_tables import Hits, SourceTensors
from planner.rows import order_and_ties
from schemas.placement import Placement
from schemas.plan import STAGING, WRITE_COLUMNS, RankPlan
from schemas.table import Table

_FINE, _STAGED, _OTHER = 0, 1, 2
"""Why a write into a stacked expert tensor can (not) follow its slot's expert."""


@dataclasses.dataclass(frozen=True)
class Groups:
    """One source rank's (stage, target) groups that hold a write into a stacked expert
    tensor: their writes as entries, group by group, each group's sorted by target region,
    source offset and target offset (what a placement does not change)."""

    at: np.ndarray
    """The groups' positions in the table, group by group, in table order (entry `i` of a
    group goes to one of its positions)."""
    group: np.ndarray
    """Each entry's group (0, 1, ...: the groups in the order of `at`)."""
    first: np.ndarray
    """Whether an entry begins its group."""
    fixed: np.ndarray
    """Each entry's source region, where it does not follow a slot (-1: it does)."""
    slot: np.ndarray
    """The slot (MoE layer * physical slots + slot) an entry writes into (the number of
    slots: none)."""
    ids_at: np.ndarray
    """Where the entry's expert's spec id is, less `weights * expert`, in `ExpertIds.ids`
    flat (its MoE layer and weight)."""
    geometry: np.ndarray
    """The geometry class of the entry's source piece (`SourceTensors.geometry`)."""
    why: np.ndarray
    """`_FINE`, or why the entry's slot may not move (`_STAGED`, `_OTHER`)."""


_KEPT: dict[int, tuple[weakref.ref, Groups | None, np.ndarray]] = {}
"""By the identity of a writes table's `src_region` column (new in every table a replan
changes; weakly held): its rank's `Groups` (None: no write into a stacked tensor) and
the row of each of its entries in that table."""


def replan_writes(rp: RankPlan, every: Hits, old: Placement, new: Placement,
                  moved: np.ndarray, src: SourceTensors, ids: ExpertIds, max_write_bytes: int,
                  sources: int, targets: int) -> RankPlan:
    """`rp` (a source rank's plan for placement `old`) for placement `new` (`moved`: per
    slot, flat, whether its expert changes, then False); `every`: every stacked expert
    tensor of the plan."""
    w = rp.writes
    if not len(w):
        return rp
    groups, rows = _groups(rp, every, old, src, ids, sources, targets)
    if groups is None:
        return rp
    m = moved[groups.slot]
    if not m.any():
        return rp
    why = groups.why[m]
    if (why == _STAGED).any():
        raise NotIncremental(f"replan: source rank {rp.rank} sends moved expert slots through "
                             "staging (packed or gathered); compile the new placement in full")
    if (why == _OTHER).any():
        raise NotIncremental(f"replan: source rank {rp.rank} writes expert slots from tensors "
                             "other than the placement's experts; compile the new placement "
                             "in full")
    touched = np.zeros(int(groups.group[-1]) + 1, bool)
    touched[groups.group[m]] = True
    sel = np.flatnonzero(touched[groups.group]) if not touched.all() else None
    pick = (lambda a: a) if sel is None else (lambda a: a[sel])
    fixed, slot, ids_at = pick(groups.fixed), pick(groups.slot), pick(groups.ids_at)
    follows = fixed < 0
    gid = ids.ids.reshape(-1)[ids_at[follows] + ids.ids.shape[2] * new.table.reshape(-1)[
        slot[follows]]]
    region_of, _ = src.of(rp.rank)
    reg = region_of[gid]
    if (reg < 0).any() or (src.geometry(rp.rank, gid) != pick(groups.geometry)[follows]).any():
        raise NotIncremental(f"replan: source rank {rp.rank} does not hold every expert of a "
                             "MoE layer with the same cut (experts placed on EP ranks?); "
                             "compile the new placement in full")
    region = fixed.copy()
    region[follows] = reg
    order = order_and_ties([pick(groups.group), region])[0]
    at, got = pick(groups.at), pick(rows)[order]
    _check_cuts(rp, at, got, pick(groups.first), max_write_bytes, sources)
    new_rows = rows.copy()
    new_rows[order if sel is None else sel[order]] = at
    writes = _placed(w, at, got, region[order])
    _KEPT[id(writes["src_region"])] = (weakref.ref(writes["src_region"]), groups, new_rows)
    return dataclasses.replace(rp, writes=writes)


def _placed(w: Table, at: np.ndarray, got: np.ndarray, region: np.ndarray) -> Table:
    """`w` with row `got[i]`'s write at position `at[i]`, reading source region
    `region[i]`; `dst_rank` is one per group, and a column no write changes stays."""
    change = at != got
    at_c, got_c = at[change], got[change]
    cols = {}
    for name, dt in WRITE_COLUMNS:
        col = w[name]
        if name == "src_region":
            col = np.array(col, dtype=dt)
            col[at] = region
        elif name != "dst_rank" and len(at_c) and not (
                name == "nbytes" and np.array_equal(col[at_c], col[got_c])):
            col = np.array(col, dtype=dt)
            col[at_c] = w[name][got_c]
        cols[name] = col
    return Table.build(WRITE_COLUMNS, **cols)


def _groups(rp: RankPlan, every: Hits, old: Placement, src: SourceTensors, ids: ExpertIds,
            sources: int, targets: int) -> tuple[Groups | None, np.ndarray]:
    """`rp`'s `Groups` (None where it writes no stacked expert tensor) and the row of each
    entry, kept or read from the table (for placement `old`)."""
    col = rp.writes["src_region"]
    kept = _KEPT.get(id(col))
    if kept is not None and kept[0]() is col:
        return kept[1], kept[2]
    groups, rows = _read(rp, every, old, src, ids, sources, targets)
    if len(_KEPT) > 128:
        for k in [k for k, v in _KEPT.items() if v[0]() is None]:
            del _KEPT[k]
    _KEPT[id(col)] = (weakref.ref(col), groups, rows)
    return groups, rows


def _read(rp: RankPlan, every: Hits, old: Placement, src: SourceTensors, ids: ExpertIds,
          sources: int, targets: int) -> tuple[Groups | None, np.ndarray]:
    w = rp.writes
    h = every.of(w["dst_rank"], w["dst_region"])  # each write's stacked tensor (-1: none)
    b = rp.batches
    group = np.repeat(b["stage"].astype(np.int64) * (sources + targets),
                      b["stop"] - b["start"])
    group += w["dst_rank"]
    hit = np.zeros(int(group.max()) + 1, bool)
    hit[group[h >= 0]] = True
    if not hit.any():
        return None, np.zeros(0, np.int64)
    sel = hit[group]
    mine = np.arange(len(w)) if sel.all() else np.flatnonzero(sel)
    g = group[mine]  # the writes of the groups: table order
    at = mine[_by_group(g)]  # group by group
    order, ties = order_and_ties([g, *(w[c][mine] for c in ("dst_region", "src_offset",
                                                        "dst_offset"))])
    entry = mine[order]  # the rows, sorted as entries
    del mine, g, order
    eg = group[entry]
    first = np.ones(len(entry), bool)
    first[1:] = eg[1:] != eg[:-1]
    if ties:
        raise NotIncremental(f"replan: source rank {rp.rank} writes the same target bytes "
                             "twice in one batch group; compile the new placement in full")
    k = h[entry]
    on = k >= 0  # the entries into stacked expert tensors
    kk = k[on]
    slot_g = every.first[kk] + w["dst_offset"][entry[on]] // every.slot_bytes[kk]
    layer = every.moe[kk]
    physical = old.table.shape[1]
    slot = np.full(len(entry), old.table.size, np.int64)
    slot[on] = layer * physical + slot_g
    src_region = w["src_region"][entry].astype(np.int64)
    region_of, gid_of_region = src.of(rp.rank)
    gid = np.full(len(entry), -1, np.int64)
    inside = src_region < len(gid_of_region)
    gid[inside] = gid_of_region[src_region[inside]]
    why = np.full(len(entry), _FINE, np.int8)
    staged = len(rp.regions) - 1 if rp.regions and rp.regions[-1].name == STAGING else -1
    gon = gid[on]
    other = (gon < 0) | (ids.expert[gon] != old.table.reshape(-1)[slot[on]]) | (
        ids.layer[gon] != layer)
    why[np.flatnonzero(on)[other]] = _OTHER
    why[on & (src_region == staged)] = _STAGED
    follows = on & (why == _FINE)
    fixed = np.where(follows, -1, src_region)
    gf = gid[follows]
    ids_at = np.zeros(len(entry), np.int64)
    n_e, n_w = ids.ids.shape[1], ids.ids.shape[2]
    ids_at[follows] = ids.layer[gf] * n_e * n_w + ids.weight[gf]
    geometry = np.zeros(len(entry), np.int64)
    geometry[follows] = src.geometry(rp.rank, gf)
    groups = Groups(at, np.cumsum(first) - 1, first, fixed, slot, ids_at, geometry, why)
    rows_of = entry
    return groups, rows_of


def _by_group(g: np.ndarray) -> np.ndarray:
    """The stable order of rows by their group number `g` (few groups: a radix sort)."""
    if not len(g) or (g[1:] >= g[:-1]).all():
        return np.arange(len(g))
    lo, hi = int(g.min()), int(g.max())
    if hi - lo < 1 << 16:
        return np.argsort((g - lo).astype(np.uint16), kind="stable")
    return np.argsort(g, kind="stable")


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


def _check_cuts(rp: RankPlan, at: np.ndarray, got: np.ndarray, first: np.ndarray,
                max_write_bytes: int, sources: int) -> None:
    """`NotIncremental` unless the writes `got` put at positions `at` (`first`: where a
    (stage, target) group starts) keep `schedule`'s batch cuts (`_rounds`)."""
    nbytes = rp.writes["nbytes"]
    a, b = nbytes[at], nbytes[got]
    if np.array_equal(a, b):
        return
    bad = _rounds(b, first, max_write_bytes) != _rounds(a, first, max_write_bytes)
    if bad.any():
        dst = int(rp.writes["dst_rank"][at[np.argmax(bad)]])
        raise NotIncremental(f"replan: source rank {rp.rank}'s batches to target rank "
                             f"{dst - sources} change their cut (writes of unequal sizes "
                             "reordered); compile the new placement in full")
