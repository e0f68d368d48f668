"""The replan's edit of a source rank's writes (`planner/replan.py`): each write into a
moved slot reads the new expert's source tensor instead (same offsets and length), and
each (stage, target) group holding such a write is put back in the order `coalesce` and
`schedule` give (source region, target region, source offset, target offset), in the same
table positions, its batch cuts unchanged.

The writes of every group holding a write into a stacked expert tensor are read once per
table (`Groups`): their positions, group by group, with each one's group, source region,
target region and offsets packed in one int64 (ascending in that order: the table's, which
is checked) and the slot it writes. A placement moves only the writes into moved slots:
their keys take the new source region and they are sorted (stably: runs). A few are put
back among the others (kept in order) by one binary search of every key, and the new
order is made only over the spans between each one's old and new place (`_windows`:
outside them no entry moves), so nothing the size of every write is copied but the
columns that change; most of a rank's writes by one stable sort of the staying keys and
the moved ones (`_merged`: two sorted runs). The index is kept for the table a replan
makes: as the edit of the old one's (`_Edited`), made only if that table is replanned.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from planner.errors import NotIncremental
from planner.passes.schedule import MAX_BATCH_WRITES
from planner.placement import ExpertIds
from planner.replan_tables import Hits, SourceTensors
from schemas.intervals import union
from schemas.placement import Placement
from schemas.plan import STAGING, WRITE_COLUMNS, RankPlan
from schemas.table import Table


@dataclasses.dataclass(frozen=True)
class Groups:
    """One source rank's (stage, target) groups that hold a write into a stacked expert
    tensor, their writes as entries group by group, each group's in table order."""

    at: np.ndarray | None
    """The entries' positions in the table (entry `i` sits at `at[i]`; None: at `i`, every
    write in a hit group and the table group by group)."""
    first: np.ndarray
    """Whether an entry begins its group."""
    key: np.ndarray
    """Each entry's (group, source region, target region, source offset, target offset)
    packed in one int64 (offsets wider than they fit: their rank among the values),
    strictly ascending."""
    shift: int
    bits: int
    """Where the source region sits in `key` (`bits` wide)."""
    slot: np.ndarray
    """The slot (MoE layer * physical slots + slot) an entry writes into (the number of
    slots: none)."""

    def place(self, entries: np.ndarray) -> np.ndarray:
        """The table positions of `entries`."""
        return entries if self.at is None else self.at[entries]


@dataclasses.dataclass(frozen=True)
class _Edited:
    """The `Groups` of a table a replan made, kept as the edit of its table's (made only
    when a replan of that table asks: a plan's first replan does not copy its index)."""

    groups: Groups
    win: np.ndarray
    key: np.ndarray
    entry: np.ndarray
    """The places that can change, the keys and the old entries there (`_windows`)."""

    def made(self) -> Groups:
        key, slot = self.groups.key.copy(), self.groups.slot.copy()
        key[self.win], slot[self.win] = self.key, self.groups.slot[self.entry]
        return dataclasses.replace(self.groups, key=key, slot=slot)


_KEPT: dict[int, tuple[weakref.ref, Groups | _Edited | None]] = {}
"""By the identity of a writes table's `src_region` column (new in every table a replan
changes; weakly held): its rank's `Groups` (None: no write into a stacked tensor), or the
edit that gives them."""


def replan_writes(rp: RankPlan, every: Hits, old: Placement, new: Placement,
                  moved: np.ndarray, src: SourceTensors, ids: ExpertIds, max_write_bytes: int,
                  sources: int, targets: int) -> RankPlan:
    """`rp` (a source rank's plan for placement `old`) for placement `new` (`moved`: per
    slot, flat, whether its expert changes, then False); `every`: every stacked expert
    tensor of the plan."""
    w = rp.writes
    if not len(w):
        return rp
    groups = _groups(rp, every, old, sources, targets)
    if groups is None:
        return rp
    m = moved[groups.slot]
    mi = np.flatnonzero(m)
    if not len(mi):
        return rp
    region = _moved_regions(rp, groups.place(mi), groups.slot[mi], old, new, src, ids)
    mask = (1 << groups.bits) - 1
    if (region >> groups.bits).any():
        raise NotIncremental(f"replan: source rank {rp.rank} reads a region past its "
                             "regions; the plan is corrupt: recompile it")
    moved_key = groups.key[mi] & ~(mask << groups.shift)
    moved_key |= region << groups.shift
    order = np.argsort(moved_key, kind="stable")  # (sorted runs: a group's writes of one
    # tensor keep their order; timsort merges runs, 5x quicker than the default here)
    moved_key, ascending, mi = moved_key[order], mi, mi[order]
    if _DENSE * len(mi) > len(m):  # most entries move: one merge of every entry
        made = _merged(groups.key, m, mi, moved_key)
    else:  # a few: only the spans they move across
        made = _spliced(groups.key, m, ascending, mi, moved_key)
    if made is None:
        raise NotIncremental(f"replan: source rank {rp.rank} writes the same target bytes "
                             "twice in one batch group; compile the new placement in full")
    win, entry, key = made
    moves = entry != win
    at_c, got_c = groups.place(win[moves]), groups.place(entry[moves])
    perm = None
    if _DENSE * len(at_c) > len(w):  # most writes change place: each column gathered whole
        perm = np.arange(len(w))
        perm[at_c] = got_c
    _check_cuts(rp, groups.at, win, entry, at_c, got_c, groups.first, max_write_bytes,
                sources, perm)
    writes = _placed(w, groups.place(win), (key >> groups.shift) & mask, at_c, got_c, perm)
    _KEPT[id(writes["src_region"])] = (weakref.ref(writes["src_region"]), dataclasses.replace(
        groups, key=key, slot=groups.slot[entry]) if len(win) == len(m) else _Edited(
        groups, win, key, entry))
    return dataclasses.replace(rp, writes=writes)


def _moved_regions(rp: RankPlan, rows: np.ndarray, slot: np.ndarray, old: Placement,
                   new: Placement, src: SourceTensors, ids: ExpertIds) -> np.ndarray:
    """The source region each write `rows` (into moved slots `slot`) reads for placement
    `new`: the new expert's piece of the same weight, checked to read the old expert's
    piece (not staging, not another tensor) and to have the same cut. (Packed ids,
    `ExpertIds.packed`: one lookup of each write's region and slot for each.)"""
    w = rp.writes
    src_region = w["src_region"][rows]
    staged = len(rp.regions) - 1 if rp.regions and rp.regions[-1].name == STAGING else -1
    if (src_region == staged).any():
        raise NotIncremental(f"replan: source rank {rp.rank} sends moved expert slots through "
                             "staging (packed or gathered); compile the new placement in full")
    packed_of_region, region_of = src.packed(rp.rank), src.of(rp.rank)
    old_le, new_le = _slot_experts(old, new, ids.ids.shape[1])
    if len(src_region) and (int(src_region.min()) < 0
                            or int(src_region.max()) >= len(packed_of_region)):
        was = np.full(len(src_region), -1, np.int64)  # (refused just below)
    else:
        was = packed_of_region[src_region]  # what each reads: (layer, expert, weight)
    if ((was >> ids.wbits) != old_le[slot]).any():  # (-1: no expert tensor)
        raise NotIncremental(f"replan: source rank {rp.rank} writes expert slots from tensors "
                             "other than the placement's experts; compile the new placement "
                             "in full")
    now = new_le[slot]  # the new expert's tensor of the same layer and weight
    now <<= ids.wbits
    now |= was & ((1 << ids.wbits) - 1)
    now = ids.of_packed[now]
    region = region_of[now]
    if (region < 0).any():  # (-1: no such tensor, or not held; `of`'s last: no tensor)
        raise _not_held(rp.rank)
    if not src.alike(rp.rank, len(now)) and not src.same_geometry(
            rp.rank, now, ids.of_packed[was]).all():
        raise _not_held(rp.rank)
    return region.astype(np.int64)


_SLOT_EXPERTS: list[tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]] = []


def _slot_experts(old: Placement, new: Placement,
                  experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Per slot (flat), MoE layer * `experts` + its expert under `old` (-2: an expert out of
    range, which no tensor matches), and under `new` (checked in range: `replan`); the
    last pair of tables' kept: every rank of a replan asks."""
    for a, b, got in _SLOT_EXPERTS:
        if a is old.table and b is new.table:
            return got
    layers, physical = old.table.shape
    base = np.repeat(np.arange(layers, dtype=np.int64) * experts, physical)
    t = old.table.reshape(-1)
    got = (np.where((t >= 0) & (t < experts), base + t, -2), base + new.table.reshape(-1))
    _SLOT_EXPERTS[:] = [(old.table, new.table, got)]
    return got


def _not_held(rank: int) -> NotIncremental:
    return NotIncremental(f"replan: source rank {rank} does not hold every expert of a MoE "
                          "layer with the same cut (experts placed on EP ranks?); compile the "
                          "new placement in full")


_DENSE = 4
"""A rank whose moved entries are over 1/`_DENSE` of its entries has them put back by one
merge of every entry (`_merged`), else by the spans they cross (`_spliced`)."""


def _merged(key: np.ndarray, moved: np.ndarray, mi: np.ndarray, moved_key: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(every place, the old entry at each, its key) with the moved entries `mi` (`moved`:
    whether each entry is one) given keys `moved_key` (sorted) and the others kept in
    order: one stable sort of the others' keys and the moved ones (two sorted runs: a
    merge); None where two keys are equal."""
    stay = np.flatnonzero(~moved)
    both = np.concatenate([key[stay], moved_key])
    order = np.argsort(both, kind="stable")
    both = both[order]
    if (both[1:] == both[:-1]).any():
        return None
    return _iota(len(key)), np.concatenate([stay, mi])[order], both


_IOTA = np.zeros(0, np.int64)


def _iota(n: int) -> np.ndarray:
    """`np.arange(n)`, read-only, a view of one kept for every rank (not made per rank)."""
    global _IOTA
    if len(_IOTA) < n:
        _IOTA = np.arange(max(n, 2 * len(_IOTA)))
        _IOTA.flags.writeable = False
    return _IOTA[:n]


def _spliced(key: np.ndarray, moved: np.ndarray, ascending: np.ndarray, mi: np.ndarray,
             moved_key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`_merged`'s (places, old entries, keys) of only the places whose entry can change
    (`_windows`), found by a binary search (`_places`; `ascending`: `mi` sorted)."""
    put = _places(key, ascending, moved_key, moved)
    if put is None or (moved_key[1:] == moved_key[:-1]).any():
        return None
    win, entry, here = _windows(mi, put)
    got = key[entry]  # the entries' keys at the places `win` in the new order
    got[here] = moved_key
    return win, entry, got


def _places(key: np.ndarray, mi: np.ndarray, moved_key: np.ndarray,
            moved: np.ndarray) -> np.ndarray | None:
    """The places in the new order of the moved entries `mi` (ascending; `moved`: whether
    each entry is one) given keys `moved_key` (sorted; each entry's place among the others'
    kept in order), by a binary search of every entry's keys (no copy of the others');
    None where a moved key equals another entry's."""
    ins = np.searchsorted(key, moved_key)  # among every entry ...
    near = np.minimum(ins, len(key) - 1)
    equal = near[key[near] == moved_key]
    if not moved[equal].all():  # (equal to a moved entry's old key: that one moves)
        return None
    ins -= np.searchsorted(mi, ins)  # ... less the moved entries before it
    ins += np.arange(len(mi))
    return ins


def _windows(mi: np.ndarray, put: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(places, the old entry at each, where among them `put` is) of the places whose entry
    can change when entries `mi` move to places `put` (in order of `put`) and the others
    keep their order: the union of the spans between each moved entry's old and new place
    (outside them every entry keeps its place), ascending."""
    a, b = union(np.minimum(mi, put), np.maximum(mi, put) + 1)  # the windows
    span = b - a
    shift = a - np.cumsum(span) + span  # a window's first place less its index in `win`
    win = np.repeat(shift, span) + np.arange(int(span.sum()))

    def index(x: np.ndarray) -> np.ndarray:  # of places `x` (all in windows) in `win`
        return x - shift[np.searchsorted(a, x, side="right") - 1]

    entry = np.empty(len(win), np.int64)
    here = index(put)
    stay = np.ones(len(win), bool)
    stay[here] = False
    entry[here] = mi
    kept = np.ones(len(win), bool)
    kept[index(mi)] = False
    entry[stay] = win[kept]
    return win, entry, here


def _placed(w: Table, at_w: np.ndarray, region: np.ndarray, at_c: np.ndarray,
            got_c: np.ndarray, perm: np.ndarray | None) -> Table:
    """`w` with row `got_c[i]`'s write at position `at_c[i]` and source region `region[i]`
    at position `at_w[i]` (a superset of `at_c` and of the moved writes' positions);
    `dst_rank` is one per group, and a column whose values the moves leave (FSDP2's
    source offsets, equal sizes) stays the same array. `perm`: the row at each position
    (given where most change: a column is then one gather)."""
    cols = {}
    for name, dt in WRITE_COLUMNS:
        col = w[name]
        if name == "src_region":
            col = np.array(col, dtype=dt)
            col[at_w] = region
        elif name != "dst_rank" and perm is not None:
            put = col[perm]
            if not np.array_equal(col, put):
                col = put if put.dtype == dt else put.astype(dt)
        elif name != "dst_rank" and len(at_c):
            put = col[got_c]
            if not np.array_equal(col[at_c], put):
                col = np.array(col, dtype=dt)
                col[at_c] = put
        cols[name] = col
    return Table.build(WRITE_COLUMNS, **cols)


def _groups(rp: RankPlan, every: Hits, old: Placement, sources: int,
            targets: int) -> Groups | None:
    """`rp`'s `Groups` (None where it writes no stacked expert tensor), kept or read from
    the table (for placement `old`)."""
    col = rp.writes["src_region"]
    kept = _KEPT.get(id(col))
    if kept is not None and kept[0]() is col:
        if isinstance(kept[1], _Edited):
            _KEPT[id(col)] = (kept[0], kept[1].made())
            return _KEPT[id(col)][1]
        return kept[1]
    groups = _read(rp, every, old, sources, targets)
    if len(_KEPT) > 128:
        for k in [k for k, v in _KEPT.items() if v[0]() is None]:
            del _KEPT[k]
    _KEPT[id(col)] = (weakref.ref(col), groups)
    return groups


def _read(rp: RankPlan, every: Hits, old: Placement, sources: int,
          targets: int) -> Groups | None:
    w = rp.writes
    h = every.of(w["dst_rank"], w["dst_region"])  # each write's stacked tensor (-1: none)
    b = rp.batches
    group = np.repeat(b["stage"].astype(np.int64) * (sources + targets),
                      b["stop"] - b["start"])
    group += w["dst_rank"]
    hit = np.zeros(int(group.max()) + 1, bool)
    hit[group[h >= 0]] = True
    if not hit.any():
        return None
    sel = hit[group]
    cols = [group, *(w[c] for c in ("src_region", "dst_region", "src_offset", "dst_offset"))]
    mine = None if sel.all() else np.flatnonzero(sel)
    if mine is not None:
        cols, h = [c[mine] for c in cols], h[mine]
    key, shift, bits = _packed(rp, cols)  # table order
    on = np.flatnonzero(h >= 0)  # the writes into stacked expert tensors
    kk = h[on]
    small = np.int32 if max(len(w), old.table.size + 1) < 1 << 31 else np.int64
    slot = np.full(len(h), old.table.size, small)  # (slots kept: int32 fits)
    base = every.moe * old.table.shape[1] + every.first  # each tensor's slot 0
    slot[on] = cols[4][on] // every.slot_bytes[kk]
    slot[on] += base[kk]
    order = _by_group(cols[0])  # group by group, each in table order (None: already)
    g = cols[0]
    if order is None:
        at = mine
    else:
        at = order if mine is None else mine[order]
        key, slot, g = key[order], slot[order], g[order]
    first = np.ones(len(key), bool)
    np.not_equal(g[1:], g[:-1], out=first[1:])
    if not (key[1:] > key[:-1]).all():
        same = bool((key[1:] == key[:-1]).any())
        raise NotIncremental(f"replan: source rank {rp.rank} " + (
            "writes the same target bytes twice in one batch group" if same else
            "has a batch group out of (source region, target region, source offset, target "
            "offset) order") + "; compile the new placement in full")
    return Groups(at, first, key, shift, bits, slot)


def _packed(rp: RankPlan, cols: list[np.ndarray]) -> tuple[np.ndarray, int, int]:
    """(group, source region, target region, source offset, target offset) per entry,
    packed in one int64 in that order, each less its least value (the source region
    field wide enough for any region of the rank: a moved write takes another); an offset
    column too wide replaced by its rank among its values; where the source region sits."""
    lo = [int(c.min()) if len(c) else 0 for c in cols]
    if lo[1] < 0:
        raise NotIncremental(f"replan: source rank {rp.rank} writes from region {lo[1]}; the "
                             "plan is corrupt: recompile it")
    lo[1] = 0
    bits = [(int(c.max()) - v).bit_length() if len(c) else 0 for c, v in zip(cols, lo)]
    bits[1] = max(bits[1], max(len(rp.regions) - 1, 0).bit_length())
    for j in (4, 3) if sum(bits) > 63 else ():
        if sum(bits) <= 63:
            break
        values, ranked = np.unique(cols[j], return_inverse=True)
        cols[j], lo[j] = ranked.reshape(-1), 0
        bits[j] = (len(values) - 1).bit_length()
    if sum(bits) > 63:
        raise NotIncremental(f"replan: source rank {rp.rank}'s writes do not pack in 63 bits "
                             "(group, source and target region and offsets); compile the new "
                             "placement in full")
    key = np.subtract(cols[0], lo[0], dtype=np.int64)  # (the table's own columns unchanged)
    part = np.empty_like(key)
    for c, v, b in zip(cols[1:], lo[1:], bits[1:]):
        key <<= b
        np.subtract(c, v, out=part, dtype=np.int64)
        key |= part
    return key, sum(bits[2:]), bits[1]


def _by_group(g: np.ndarray) -> np.ndarray | None:
    """The stable order of rows by their group number `g` (few groups: a radix sort); None
    where they are in it."""
    if not len(g) or (g[1:] >= g[:-1]).all():
        return None
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


def _check_cuts(rp: RankPlan, at: np.ndarray | None, win: np.ndarray, entry: np.ndarray,
                at_c: np.ndarray, got_c: np.ndarray, first: np.ndarray, max_write_bytes: int,
                sources: int, perm: np.ndarray | None = None) -> None:
    """`NotIncremental` unless the writes put in the new order (`entry[i]`'s at place
    `win[i]`, the others staying; `at`: each entry's position, None: its index; `at_c`,
    `got_c`: the positions that change and the write put there, `perm`: the row at each
    position, or None; `first`: where a (stage, target) group starts) keep `schedule`'s
    batch cuts (`_rounds`)."""
    nbytes = rp.writes["nbytes"]
    if np.array_equal(nbytes[at_c], nbytes[got_c]) if perm is None else np.array_equal(
            nbytes, nbytes[perm]):
        return
    if at is None:
        at = np.arange(len(first))
    order = np.arange(len(at))
    order[win] = entry
    a, b = nbytes[at], nbytes[at[order]]
    bad = _rounds(b, first, max_write_bytes) != _rounds(a, first, max_write_bytes)
    if bad.any():
        dst = int(rp.writes["dst_rank"][at[np.argmax(bad)]])
        raise NotIncremental(f"replan: source rank {rp.rank}'s batches to target rank "
                             f"{dst - sources} change their cut (writes of unequal sizes "
                             "reordered); compile the new placement in full")
