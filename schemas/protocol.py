"""The plan's semantics: every rule that the executor, the simulator, `verify`, the compiler
passes and the tests share, written once.

A rank's work per step (`run()`), stage by stage 0..stages-1 (the executor's whole protocol):
  1. send the `READY` signals `signals` lists for this stage (targets, stage 0: "my tensors
     may be overwritten now"), then wait for the `READY` and `ACK` signals `waits` lists for
     this stage;
  2. run this stage's `PACK` copies (strided gather and/or cast into staging);
  3. post this stage's `writes`, batch by batch, and wait for their completion;
  4. send the `DONE` signals `signals` lists for this stage;
  5. wait for the `DONE` signals `waits` lists for this stage (all data has landed);
  6. run this stage's `UNPACK` copies (staging -> physical tensors);
  7. send the `ACK` signals `signals` lists for this stage.
Matching: a signal carries (fingerprint, step, stage it was sent in, kind). A `READY` or
`DONE` wait at stage s matches the peer's signal sent in stage s of the same step; an
`ACK` wait at stage s matches the peer's `ACK` sent in stage s-1 of the same step (the
peer's staging, written in stage s, is free again); a `SLOT_ACK` wait at stage s matches
the peer's `SLOT_ACK` sent in stage s-SLOTS (the peer's staging is used in slots: what
stage s writes there, stages s-1 .. s-SLOTS+1 never read; `verify` checks it). Both kinds
of ACK go out in step 7. Every rank walks every stage, so the
order is a DAG: READY -> packs -> writes -> DONE -> unpacks -> ACK -> next stage's writes.
Two overlaps the executor applies, both decided by the plan alone (below): a stage's packs
run during the previous stage's writes where allowed; and a rank that waits for no DONE,
unpacks nothing and ACKs nothing in stage s goes on to stage s+1 (steps 1-3) once its
stage-s writes are posted, if s+1's waits have arrived and its packs ran early; the DONE of
stage s goes out when its writes have landed (step 4 late, never early).

The rules, each with its one home here:

- Signals: an `ACK` awaited in stage s was sent in stage s-1, a `SLOT_ACK` in stage s-SLOTS
  (`LAG`, `sent_stage`, `wait_stage`); `READY` and `DONE` match in the same stage.
- Staging: the last region of a rank when it is named `STAGING` (`staging_index`); the
  compiler gives stage s the slot `s % SLOTS` of it (slot k starts where slot k-1 ends,
  each as large as the most one of the rank's stages puts there: staging is sized to
  need, within the rank's budget: `options.staging_bytes` caps it, targets get only what
  keeps the write window full).
- The stage of a write is its batch's (`write_stages`).
- Carry-over (`carries`): a rank may leave stage s with its writes still in flight only where
  it waits for no DONE, unpacks nothing and sends no ACK in s, and s is not its last stage;
  at run time it also needs s+1's READY/ACK waits arrived and s+1's packs prepacked (or none).
- Early packs (`Overlap`, `prepacked`): a stage's PACK/QUANT copies run during the previous
  stage's writes when that cannot change what any byte holds (rules below).
- Item sizes by dtype code (`ITEM`), the FP8 block (`FP8_BLOCK`, `FP8_MAX`), a QUANT op's
  scales: how many (`scale_blocks`) and where (`quant_scales`, `scale_stride`).
- Footprints (`write_footprint`, `copy_footprint`): the bytes every op kind touches in its
  regions, the one bounds proof of the executor's load-time check and of `verify`.
- Limits (`MAX_OPS`, `MAX_VALUE`; a header's `MAX_WORLD`, `MAX_STAGES` are in
  `schemas/header.py`): what a plan can make a process allocate or loop over, checked
  before anything is allocated.

Early packs. A source's stage s runs its PACK and QUANT copies, then posts its writes; a
stage `s >= 1` is *prepacked* instead (its copies run while the writes of stage `s - 1`
are in flight) when:
  1. none of its copies reads staging, and all of them write staging (they read only the
     rank's own tensors, which do not change during a step);
  2. the staging bytes its copies write are disjoint from every staging byte that stages
     `s - 1` .. `s - SLOTS + 1` read on this rank: the sources of their writes and of their
     unpacks. (Writes of older stages still in flight that read those bytes land first:
     `Overlap.blockers`.)
The plan alone decides it: nothing here depends on the run.
"""

from __future__ import annotations

import numpy as np

from schemas.intervals import ends_by_start, meets, overlap_by_group
from schemas.plan import (
    ACK,
    DONE,
    DTYPE_CODES,
    ITEMSIZE,
    PACK,
    QUANT,
    READY,
    SLOT_ACK,
    STAGING,
    UNPACK,
    RankPlan,
)
from schemas.table import among, content_key, table_digest

ITEM = np.array([ITEMSIZE[d] for d in DTYPE_CODES], dtype=np.int64)
"""Bytes of one element, by dtype code (`schemas.plan.DTYPE_CODES`)."""
FP8_CODE = DTYPE_CODES.index("float8_e4m3fn")
FP8_BLOCK = 128
"""A QUANT op's scale block: one float32 scale per `FP8_BLOCK` x `FP8_BLOCK` values."""
FP8_MAX = 448.0
"""Largest e4m3 value: a block's scale is `max(amax, 1e-4) / FP8_MAX`."""
SCALE_BYTES = 4
"""Bytes of one scale (float32); `aux_offset` counts them."""
SLOTS = 3
"""The compiler gives stage s the slot `s % SLOTS` of the rank's staging (each slot at most
a third of the rank's budget, `planner/passes/budget.py`); the early-pack rule checks the
`SLOTS - 1` stages before s."""
ALIGN = 64
"""Byte alignment of every offset the compiler places in a buffer: staging slots and the
pools and runs in them (`planner/passes/budget.py`, `staging.py`, `gather*.py`), a shadow
section's chunks, and a chunked shadow's tensors in its N-byte buffer
(`schemas.chunked_plan.bases`)."""
INFLIGHT = 8
"""Batches a rank keeps posted and not yet landed, by default: the executor's
`max_inflight`, the simulator's `inflight` (`rdma-plan simulate --inflight`), and the write
window a target's staging is sized to keep full (`planner/passes/budget.py`)."""

MAX_OPS = 1 << 26
"""Rows of one table of one rank (writes, batches, copies, signals, waits)."""
MAX_VALUE = 1 << 60
"""Any offset or byte count beyond this is corrupt (and could overflow int64)."""
MAX_DIM = (1 << 31) - 1
"""Any box size or stride beyond this is corrupt."""


# ------------------------------------------------------------------------ signals

ACKS = (ACK, SLOT_ACK)
"""The kinds that free staging: sent after the unpacks (step 7), awaited before writes."""
LAG = np.array([0, 1, 0, SLOTS], dtype=np.int64)
"""Stages between a signal's sending and its wait, by kind (DONE, ACK, READY, SLOT_ACK)."""
KINDS = (DONE, ACK, READY, SLOT_ACK)


_LAGS = dict(enumerate(LAG.tolist()))


def _lag(kind: int | np.ndarray) -> int | np.ndarray:
    if type(kind) is int:  # the executor's per-step path: no numpy call
        return _LAGS.get(kind, 0)
    if np.ndim(kind) == 0:
        k = int(kind)
        return int(LAG[k]) if 0 <= k < len(LAG) else 0
    k = np.asarray(kind).astype(np.int64)
    return np.where((k >= 0) & (k < len(LAG)), LAG[np.clip(k, 0, len(LAG) - 1)], 0)


def sent_stage(kind: int | np.ndarray, wait_stage: int | np.ndarray) -> int | np.ndarray:
    """The stage a signal awaited in `wait_stage` is sent in (an ACK: the stage before; a
    SLOT_ACK: `SLOTS` stages before)."""
    return wait_stage - _lag(kind)


def wait_stage(kind: int | np.ndarray, sent_stage: int | np.ndarray) -> int | np.ndarray:
    """The stage a signal sent in `sent_stage` is awaited in (an ACK: the stage after; a
    SLOT_ACK: `SLOTS` stages after)."""
    return sent_stage + _lag(kind)


# ------------------------------------------------------------------------ staging, stages

def staging_index(rp: RankPlan) -> int:
    """Index of the rank's staging region, or -1 if it has none."""
    return len(rp.regions) - 1 if rp.regions and rp.regions[-1].name == STAGING else -1


def write_stages(rp: RankPlan) -> np.ndarray:
    """The stage of every write of the rank (from its batches; writes no batch covers:
    stage 0)."""
    b, n = rp.batches, len(rp.writes)
    start, stop = b["start"].astype(np.int64), b["stop"].astype(np.int64)
    if len(b) and start[0] == 0 and stop[-1] == n and (stop >= start).all() \
            and np.array_equal(start[1:], stop[:-1]):
        return np.repeat(b["stage"].astype(np.int64), stop - start)
    stage = np.zeros(n, dtype=np.int64)  # a malformed plan (`verify` reports it)
    for a, z, s in zip(start.tolist(), stop.tolist(), b["stage"].tolist()):
        stage[min(max(a, 0), n):min(max(z, 0), n)] = s
    return stage


def carries(rp: RankPlan) -> np.ndarray:
    """`out[s]`: the rank may go on to stage s+1 with stage s's writes in flight (the static
    part of carry-over, module doc): s is not its last stage, and in s it waits for no DONE,
    unpacks nothing and sends no ACK."""
    out = np.zeros(rp.stages, dtype=bool)
    if rp.stages < 2:
        return out
    out[:-1] = True
    for table, kinds in ((rp.waits, (DONE,)), (rp.signals, ACKS)):
        st = table["stage"][among(table["kind"], kinds)]
        out[st[(st >= 0) & (st < rp.stages)]] = False
    st = rp.copies["stage"][rp.copies["kind"] == UNPACK]
    out[st[(st >= 0) & (st < rp.stages)]] = False
    return out


# ------------------------------------------------------------------------ footprints

def scale_blocks(size0: int | np.ndarray, size1: int | np.ndarray) -> int | np.ndarray:
    """Float32 scales a QUANT of a `size0` x `size1` box writes: one per 128x128 block."""
    return -(-size0 // FP8_BLOCK) * -(-size1 // FP8_BLOCK)


def scale_stride(dst_stride0: int | np.ndarray) -> int | np.ndarray:
    """Row stride (float32 elements) of a QUANT's scales: its e4m3 rows are `dst_stride0`
    apart, as in a row-major box `dst_stride0` wide, and its scales are laid out as that
    box's would be (`ceil(dst_stride0 / 128)` per block row). So a QUANT of a block-aligned
    part of a box puts its values and its scales where a QUANT of the whole box would."""
    return -(-dst_stride0 // FP8_BLOCK)


def write_footprint(rp: RankPlan, side: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(region, lo, hi): the bytes `[lo, hi)` every write reads (`src`, this rank) or writes
    (`dst`, region of `dst_rank`)."""
    w = rp.writes
    lo = w[f"{side}_offset"].astype(np.int64)
    return w[f"{side}_region"].astype(np.int64), lo, lo + w["nbytes"]


def _dims(rp: RankPlan, rows: np.ndarray, side: str, quant: np.ndarray
          ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Box sizes and strides of `rows` on `side`: a QUANT's box is 2-d (its size2 is
    ignored) and its dst rows are contiguous (`size1` elements, `dst_stride0` apart)."""
    c = rp.copies
    sizes = [c[f"size{d}"][rows].astype(np.int64) for d in range(3)]
    strides = [c[f"{side}_stride{d}"][rows].astype(np.int64) for d in range(3)]
    sizes[2] = np.where(quant, 1, sizes[2])
    if side == "dst":
        strides[1] = np.where(quant, 1, strides[1])
    return sizes, strides


def quant_scales(rp: RankPlan, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                          np.ndarray]:
    """(offset, block rows, block cols, row stride) of the float32 scales QUANT `rows`
    write, all in float32 elements of their dst region."""
    c = rp.copies
    m, n = c["size0"][rows].astype(np.int64), c["size1"][rows].astype(np.int64)
    return (c["aux_offset"][rows].astype(np.int64), -(-m // FP8_BLOCK), -(-n // FP8_BLOCK),
            scale_stride(c["dst_stride0"][rows].astype(np.int64)))


def copy_footprint(rp: RankPlan, side: str, rows: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(row, region, lo, hi): byte intervals `[lo, hi)` holding everything copies `rows`
    touch on `side`: the extent of their strided boxes (offsets and strides in elements of
    that side's dtype; an empty box touches nothing); a QUANT's dst also holds its float32
    scales at `aux_offset` (`quant_scales`). One interval per row, a QUANT's dst two.
    Values must be in range (`check_copy_values`): the extents are exact int64."""
    c = rp.copies
    rows = np.arange(len(c)) if rows is None else np.asarray(rows, dtype=np.int64)
    quant = c["kind"][rows] == QUANT
    sizes, strides = _dims(rp, rows, side, quant)
    es = ITEM[np.clip(c[f"{side}_dtype"][rows].astype(np.int64), 0, len(ITEM) - 1)]
    lo = c[f"{side}_offset"][rows].astype(np.int64)
    last = lo.copy()
    for n, st in zip(sizes, strides):
        last += (n - 1) * st
    empty = np.any([n <= 0 for n in sizes], axis=0) if len(rows) else np.zeros(0, bool)
    lo, hi = lo * es, np.where(empty, lo, last + 1) * es
    region = c[f"{side}_region"][rows].astype(np.int64)
    if side == "dst" and quant.any():
        q = rows[quant]
        a, rb, cb, st = quant_scales(rp, q)
        last = np.where((rb > 0) & (cb > 0), a + (rb - 1) * st + cb, a)
        rows, region = np.concatenate([rows, q]), np.concatenate([region, region[quant]])
        lo, hi = np.concatenate([lo, a * SCALE_BYTES]), np.concatenate([hi, last * SCALE_BYTES])
    return rows, region, lo, hi


def copy_value_problems(rp: RankPlan) -> np.ndarray:
    """Rows whose offsets, strides or sizes are out of range for `copy_footprint` (negative,
    or so large that an extent could overflow)."""
    c = rp.copies
    bad = np.zeros(len(c), dtype=bool)
    for side in ("src", "dst"):
        bad |= (c[f"{side}_offset"] < 0) | (c[f"{side}_offset"] > MAX_VALUE)
        for d in range(3):
            bad |= (c[f"{side}_stride{d}"] < 0) | (c[f"{side}_stride{d}"] > MAX_DIM)
    for d in range(3):
        bad |= (c[f"size{d}"] < 0) | (c[f"size{d}"] > MAX_DIM)
    bad |= (c["aux_offset"] < 0) | (c["aux_offset"] > MAX_VALUE)
    if bad.all():
        return bad
    ok = np.flatnonzero(~bad)  # the extent, in floats first: no int64 overflow below
    for side in ("src", "dst"):
        ext = c[f"{side}_offset"][ok].astype(np.float64)
        for d in range(3):
            ext += c[f"size{d}"][ok].astype(np.float64) * c[f"{side}_stride{d}"][ok]
        bad[ok[ext > MAX_VALUE / 8]] = True
    return bad


def overlapping_dst(rp: RankPlan) -> np.ndarray:
    """Rows whose dst box could write one element twice (a copy into it is refused by torch
    or races): its dims of size > 1, by stride, must each step past the extent of the
    smaller ones."""
    c = rp.copies
    bad = np.zeros(len(c), dtype=bool)
    if not len(c):
        return bad
    quant = c["kind"] == QUANT
    sizes, strides = _dims(rp, np.arange(len(c)), "dst", quant)
    n, st = np.stack(sizes, axis=1), np.stack(strides, axis=1)
    st = np.where(n > 1, st, np.iinfo(np.int64).max)  # dims of size 1 never overlap
    order = np.argsort(st, axis=1, kind="stable")
    n, st = np.take_along_axis(n, order, 1), np.take_along_axis(st, order, 1)
    reach = np.zeros(len(c), dtype=np.int64)  # last element offset of the smaller dims
    for d in range(3):
        used = n[:, d] > 1
        bad |= used & (st[:, d] <= reach)
        reach = np.where(used, reach + (n[:, d] - 1) * np.minimum(st[:, d], MAX_DIM), reach)
    return bad


# ------------------------------------------------------------------------ early packs

def overlaps(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether any interval of `a` shares a byte with any interval of `b`."""
    return meets(a, ends_by_start(*b))


def copy_extents(rp: RankPlan, side: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Byte intervals `[lo, hi)` holding everything copies `rows` touch on `side`."""
    _, _, lo, hi = copy_footprint(rp, side, rows)
    return lo, hi


class Overlap:
    """The early-pack rule applied to one rank: `prepacked[s]`, and per stage the staging
    bytes it reads (`reads`: sources of its writes and unpacks) and its packs write
    (`packs`)."""

    def __init__(self, rp: RankPlan) -> None:
        self.prepacked = np.zeros(rp.stages, dtype=bool)
        self._meets: dict[tuple[int, int], bool] = {}  # (s, k) -> what `blockers` found
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self.reads = [empty] * rp.stages
        self.packs = [empty] * rp.stages
        sg = staging_index(rp)
        c = rp.copies
        if sg < 0 or rp.stages < 2 or not len(c):
            return
        w, w_stage = rp.writes, write_stages(rp)
        ok = np.flatnonzero((w_stage >= 0) & (w_stage < rp.stages) & (w["src_region"] == sg))
        unp = np.flatnonzero((c["kind"] == UNPACK) & (c["src_region"] == sg)
                             & (c["stage"] >= 0) & (c["stage"] < rp.stages))
        u_lo, u_hi = copy_extents(rp, "src", unp)
        lo_w = w["src_offset"][ok].astype(np.int64)
        hi_w = lo_w + w["nbytes"][ok]
        wr = _by_stage(w_stage[ok], lo_w, hi_w)  # one sort, not a mask a stage
        un = _by_stage(c["stage"][unp], u_lo, u_hi)
        for st in sorted(wr.keys() | un.keys()):
            (lo, hi), (ulo, uhi) = wr.get(st, empty), un.get(st, empty)
            self.reads[st] = (np.concatenate([lo, ulo]), np.concatenate([hi, uhi]))
        packing = (c["kind"] == PACK) | (c["kind"] == QUANT)
        rows = np.flatnonzero(packing & (c["stage"] >= 1) & (c["stage"] < rp.stages))
        out, _, lo, hi = copy_footprint(rp, "dst", rows)  # a QUANT's scales after the rows
        packs = _by_stage(c["stage"][out], lo, hi)
        bad = np.zeros(rp.stages, dtype=bool)  # rule 1 (and a pack into a tensor is never early)
        bad[c["stage"][rows[(c["src_region"][rows] == sg) | (c["dst_region"][rows] != sg)]]] = True
        for st in sorted(packs):
            self.packs[st] = packs[st]
        # rule 2, every stage at once: stage k's reads tagged with each stage k+1 ..
        # k+SLOTS-1 whose packs they must not meet
        r_st = np.concatenate([w_stage[ok], c["stage"][unp].astype(np.int64)])
        r_lo, r_hi = np.concatenate([lo_w, u_lo]), np.concatenate([hi_w, u_hi])
        lag = np.arange(1, SLOTS)
        hit = overlap_by_group(c["stage"][out].astype(np.int64), lo, hi,
                               (r_st[None, :] + lag[:, None]).reshape(-1),
                               np.tile(r_lo, len(lag)), np.tile(r_hi, len(lag)))
        bad[c["stage"][out][hit]] = True
        packed = np.array(sorted(packs), dtype=np.int64)
        self.prepacked[packed] = ~bad[packed]

    def blockers(self, s: int, inflight: set[int] | list[int]) -> list[int]:
        """Stages among `inflight` (older than the rule covers) whose writes read staging
        that the early packs of stage `s` write: they must land first."""
        return sorted(k for k in inflight if k <= s - SLOTS and self._meet(s, k))

    def _meet(self, s: int, k: int) -> bool:
        """Whether stage `s`'s packs write staging that stage `k`'s writes read, found once
        per pair (a simulation asks again for every batch that lands)."""
        got = self._meets.get((s, k))
        if got is None:
            got = self._meets[(s, k)] = overlaps(self.packs[s], self.reads[k])
        return got


def _by_stage(stage: np.ndarray, lo: np.ndarray, hi: np.ndarray
              ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Intervals `[lo, hi)` grouped by `stage`, each group in its original order."""
    order = np.argsort(stage, kind="stable")
    stage, lo, hi = stage[order], lo[order], hi[order]
    keys, starts = np.unique(stage, return_index=True)
    ends = np.append(starts[1:], len(stage))
    return {int(k): (lo[a:b], hi[a:b]) for k, a, b in zip(keys.tolist(), starts.tolist(),
                                                          ends.tolist())}


_OVERLAPS: dict[bytes, Overlap] = {}
OVERLAPS_MAX = 256


def overlap(rp: RankPlan) -> Overlap:
    """`Overlap(rp)`, read-only, made once for ranks with equal inputs to it (its copies,
    its writes' sources and stages, its stages and staging index: every shard of one
    pipeline stage, every replica), kept by a digest of them (`schemas.table.content_key`)."""
    sg = staging_index(rp)
    if sg < 0 or rp.stages < 2 or not len(rp.copies):
        return Overlap(rp)  # nothing to find: made at once
    w = rp.writes
    key = content_key(table_digest(rp.copies), w["src_region"], w["src_offset"], w["nbytes"],
                      write_stages(rp), rp.stages, sg)
    ov = _OVERLAPS.get(key)
    if ov is None:
        ov = Overlap(rp)
        ov.prepacked.flags.writeable = False
        if len(_OVERLAPS) >= OVERLAPS_MAX:
            _OVERLAPS.clear()
        _OVERLAPS[key] = ov
    return ov


def prepacked(rp: RankPlan) -> np.ndarray:
    """`out[s]`: stage s's PACK/QUANT copies run during stage s-1's writes (module doc)."""
    return overlap(rp).prepacked
