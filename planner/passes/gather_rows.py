"""One gathered box's chunks and fan-out as columns (`gather.py`'s `Gatherer.add`).

The same rows, in the same order, as `add`'s row-by-row path (`_choose`, `_gather_part`,
`_fan_out`), for the boxes they fit: every chunk of the box has one holder (`owner`), no
rank packs two of its parts into pool 1 (`gather_parts`), no chunk or target is
transposed and every FP8 target has its scale piece. Each function says None or False
where the box does not fit, before changing anything; `add` then takes the row path
(which also raises the errors).
"""

from __future__ import annotations

import numpy as np

from planner.passes.gather_box import Box, GatherState, Slot, pick_owner
from schemas.plan import PACK
from schemas.protocol import ALIGN
from schemas.protocol import FP8_BLOCK as BLOCK


def owner(g: GatherState, t: int) -> tuple[int, list[int], int] | None:
    """Box `t`'s owner (`pick_owner`), the source piece row of each chunk, and how many
    ranks hold any of it."""
    if g.multi[t]:
        return None
    ch, lo, hi = g.chunks, g.chunk_ptr_l[t], g.chunk_ptr_l[t + 1]
    h = ch.holders[ch.holder_ptr[ch.sbox[lo:hi]]].astype(np.int64)
    rank, size = g.src.rank[h].astype(np.int64), ch.size0[lo:hi] * ch.size1[lo:hi]
    if len(set(rank.tolist())) == len(rank):  # each chunk on a rank of its own (the owner
        ranks, held = rank, size  # does not depend on the ranks' order)
    else:
        ranks, at = np.unique(rank, return_inverse=True)
        held = np.zeros(len(ranks), dtype=np.int64)
        np.add.at(held, at.reshape(-1), size)
    return pick_owner(ranks, held, g.load, g.nic_a, g.fanout), h.tolist(), len(ranks)


def gather_parts(g: GatherState, b: Box, slot: Slot) -> bool:
    """`_gather_part` of every chunk of `b` into the owner's staging, as columns."""
    ch, lo, hi = g.chunks, b.chunks.start, b.chunks.stop
    h = np.array(b.rows, dtype=np.int64)
    s = g.src  # (only the columns read: int64, as `src_rows` makes them)
    a0, a1, region, hr, base = (getattr(s, c)[h].astype(np.int64, copy=False) for c in (
        "a0", "a1", "region", "rank", "base"))
    c0, c1, m0, m1 = ch.off0[lo:hi], ch.off1[lo:hi], ch.size0[lo:hi], ch.size1[lo:hi]
    es, o, n1 = b.es, b.owner, b.n1
    own = hr == o
    rows_ok = (a1 == 1) | (m1 == 1)  # a column is one strided run
    dense = rows_ok & ((m0 == 1) | (a0 == m1))
    if (~own & ~rows_ok).any():
        return False
    want = ~own & ~dense & ((m1 == n1) | (m0 == 1))  # pack on the holder, then one write
    hb = hr[want]
    if len(hb) > 1 and len(set(hb.tolist())) < len(hb):
        return False
    nbytes = m0 * m1 * es
    packed = np.zeros(len(h), dtype=bool)
    off = np.zeros(len(h), dtype=np.int64)
    any_packed = False
    if len(hb):
        used = g.alloc.pool1_used(slot.gather)
        need = -(-nbytes[want] // ALIGN) * ALIGN
        at = used[hb]
        fit = at + need <= g.alloc.caps[1]
        used[hb[fit]] = at[fit] + need[fit]
        g.alloc.peak1[hb[fit]] = np.maximum(g.alloc.peak1[hb[fit]], at[fit] + need[fit])
        packed[want] = fit
        off[np.flatnonzero(want)[fit]] = at[fit]
        any_packed = bool(fit.any())
    far = ~own & (g.host_a[hr] != g.host[o])  # its NIC sends the part
    if far.any():
        np.add.at(g.load, g.nic_a[hr[far]], nbytes[far])
    start = base + c0 * a0 + c1 * a1
    into = slot.g_off // es + (c0 - b.t0) * n1 + (c1 - b.t1)
    stg, stg_h = g.stg[o], g.n_regions[hr].astype(np.int64)
    copy = own | packed
    n_copies, n_writes = len(g.out.copies), len(g.out.writes)
    g.out.copies.extend(_table(copy, (
        np.where(own, o, hr), PACK, slot.gather, region, b.src_code, start, a0, a1, 1,
        np.where(own, stg, stg_h), b.src_code, np.where(own, into, off // es),
        np.where(own, n1, m1), 1, 1, m0, m1, 1, 0) if any_packed else (
        o, PACK, slot.gather, region, b.src_code, start, a0, a1, 1, stg, b.src_code, into,
        n1, 1, 1, m0, m1, 1, 0)))  # (only the owner's own parts)
    sent = ~own
    runs = _table(sent, (
        hr, np.where(packed, stg_h, region), np.where(packed, off, start * es), o, stg,
        into * es, np.where(packed, 1, m0), np.where(packed, nbytes, m1 * es),
        np.where(packed, 0, a0 * es), np.where(packed, 0, n1 * es), slot.gather) if any_packed
        else (hr, region, start * es, o, stg, into * es, m0, m1 * es, a0 * es, n1 * es,
              slot.gather))
    single = g.out.run_rows(runs)
    if any_packed:  # (copy, write, rank, element size) of each part packed into pool 1
        ci = n_copies + np.cumsum(copy)[packed] - 1
        wi = n_writes + np.cumsum(single)[packed[sent]] - 1
        g.out.pool1.extend(_table(packed, (ci, wi, hr[packed], es), picked=True))
    return True


def fan_out(g: GatherState, b: Box, slot: Slot, f_off: int, i: np.ndarray) -> bool:
    """`_fan_out` to every target row `i` (int64), as columns: the values, then the
    scales."""
    w = g.w
    if (b.n1 > 1 and (w.a1[i] != 1).any()) or (b.quant and (g.scale_j[i] < 0).any()):
        return False
    es_d, n0, n1, o = b.es_d, b.n0, b.n1, b.owner
    stg, n = g.stg[o], len(i)
    rank, region = w.rank[i], w.region[i]
    d = w.base[i] + b.t0 * w.a0[i] + b.t1 * w.a1[i]
    runs = np.empty((n, 2 if b.quant else 1, 11), dtype=np.int64)
    for k, col in enumerate((o, stg, f_off, rank, region, d * es_d, n0, n1 * es_d,
                             n1 * es_d, w.a0[i] * es_d, slot.convert)):
        runs[:, 0, k] = col
    if b.quant:  # each target's scales right after its values
        s, j = g.s, g.scale_j[i]
        rb, cb = -(-n0 // BLOCK), -(-n1 // BLOCK)
        sd = s.base[j] + (b.t0 // BLOCK) * s.a0[j] + (b.t1 // BLOCK) * s.a1[j]
        for k, col in enumerate((o, stg, slot.s_off, rank, s.region[j], sd * 4, rb, cb * 4,
                                 cb * 4, s.a0[j] * 4, slot.convert)):
            runs[:, 1, k] = col
    g.out.run_rows(runs.reshape(-1, 11))
    explain = np.empty((n, 6), dtype=np.int64)
    for k, col in enumerate((b.tensor, o, stg, rank, region, b.numel * es_d)):
        explain[:, k] = col
    g.out.explain.extend(explain)
    return True


def _table(rows: np.ndarray, cols: tuple[object, ...], picked: bool = False
           ) -> np.ndarray:
    """An int64 table of the columns `cols` (arrays over all of the box's chunks, or one
    int for all) at the chunks where `rows` (a mask) is set; `picked`: the arrays are
    already of those chunks alone."""
    at = np.flatnonzero(rows)
    out = np.empty((len(at), len(cols)), dtype=np.int64)
    for k, col in enumerate(cols):
        out[:, k] = col if picked or not isinstance(col, np.ndarray) else col[at]
    return out
