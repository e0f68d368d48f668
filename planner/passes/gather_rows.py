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
    ranks, at = np.unique(g.src.rank[h], return_inverse=True)
    held = np.zeros(len(ranks), dtype=np.int64)
    np.add.at(held, at.reshape(-1), ch.size0[lo:hi] * ch.size1[lo:hi])
    return pick_owner(ranks, held, g.load, g.nic_a, g.fanout), h.tolist(), len(ranks)


def gather_parts(g: GatherState, b: Box, slot: Slot) -> bool:
    """`_gather_part` of every chunk of `b` into the owner's staging, as columns."""
    ch, lo, hi = g.chunks, b.chunks.start, b.chunks.stop
    h = np.array(b.rows, dtype=np.int64)
    src = g.src_rows(h)
    c0, c1, m0, m1 = ch.off0[lo:hi], ch.off1[lo:hi], ch.size0[lo:hi], ch.size1[lo:hi]
    a0, a1, region, hr = src.a0, src.a1, src.region, src.rank
    es, o, n1 = b.es, b.owner, b.n1
    own = hr == o
    rows_ok = (a1 == 1) | (m1 == 1)  # a column is one strided run
    dense = rows_ok & ((m0 == 1) | (a0 == m1))
    if (~own & ~rows_ok).any():
        return False
    want = ~own & ~dense & ((m1 == n1) | (m0 == 1))  # pack on the holder, then one write
    hb = hr[want]
    if len(np.unique(hb)) < len(hb):
        return False
    nbytes = m0 * m1 * es
    used = g.alloc.pool1_used(slot.gather)
    need = -(-nbytes[want] // ALIGN) * ALIGN
    at = used[hb]
    fit = at + need <= g.alloc.caps[1]
    used[hb[fit]] = at[fit] + need[fit]
    g.alloc.peak1[hb[fit]] = np.maximum(g.alloc.peak1[hb[fit]], at[fit] + need[fit])
    packed = np.zeros(len(h), dtype=bool)
    packed[want] = fit
    off = np.zeros(len(h), dtype=np.int64)
    off[np.flatnonzero(want)[fit]] = at[fit]
    far = ~own & (g.host_a[hr] != g.host[o])  # its NIC sends the part
    np.add.at(g.load, g.nic_a[hr[far]], nbytes[far])
    start = src.base + c0 * a0 + c1 * a1
    into = slot.g_off // es + (c0 - b.t0) * n1 + (c1 - b.t1)
    stg, stg_h = g.stg[o], g.n_regions[hr].astype(np.int64)
    one = np.ones(len(h), dtype=np.int64)
    copy = own | packed
    n_copies, n_writes = len(g.out.copies), len(g.out.writes)
    g.out.copies.extend(np.stack([
        np.where(own, o, hr), one * PACK, one * slot.gather, region, one * b.src_code, start,
        a0, a1, one, np.where(own, stg, stg_h), one * b.src_code,
        np.where(own, into, off // es), np.where(own, n1, m1), one, one, m0, m1, one,
        one * 0], axis=1)[copy])
    sent = ~own
    runs = np.stack([
        hr, np.where(packed, stg_h, region), np.where(packed, off, start * es), one * o,
        one * stg, into * es, np.where(packed, 1, m0), np.where(packed, nbytes, m1 * es),
        np.where(packed, 0, a0 * es), np.where(packed, 0, n1 * es), one * slot.gather],
        axis=1)[sent]
    single = g.out.run_rows(runs)
    if packed.any():  # (copy, write, rank, element size) of each part packed into pool 1
        ci = n_copies + np.cumsum(copy)[packed] - 1
        wi = n_writes + np.cumsum(single)[packed[sent]] - 1
        g.out.pool1.extend(np.stack([ci, wi, hr[packed], one[packed] * es], axis=1))
    return True


def fan_out(g: GatherState, b: Box, slot: Slot, f_off: int, to: list[int]) -> bool:
    """`_fan_out` to every target row `to`, as columns: the values, then the scales."""
    w, i = g.w, np.array(to, dtype=np.int64)
    if ((w.a1[i] != 1) & (b.n1 > 1)).any() or (b.quant and (g.scale_j[i] < 0).any()):
        return False
    es_d, n0, n1, o = b.es_d, b.n0, b.n1, b.owner
    stg, one = g.stg[o], np.ones(len(i), dtype=np.int64)
    rank, region = w.rank[i].astype(np.int64), w.region[i].astype(np.int64)
    d = w.base[i] + b.t0 * w.a0[i] + b.t1 * w.a1[i]
    runs = np.stack([one * o, one * stg, one * f_off, rank, region, d * es_d, one * n0,
                     one * n1 * es_d, one * n1 * es_d, w.a0[i] * es_d, one * slot.convert],
                    axis=1)
    if b.quant:
        s, j = g.s, g.scale_j[i]
        rb, cb = -(-n0 // BLOCK), -(-n1 // BLOCK)
        sd = s.base[j] + (b.t0 // BLOCK) * s.a0[j] + (b.t1 // BLOCK) * s.a1[j]
        scales = np.stack([one * o, one * stg, one * slot.s_off, rank, s.region[j], sd * 4,
                           one * rb, one * cb * 4, one * cb * 4, s.a0[j] * 4,
                           one * slot.convert], axis=1)
        runs = np.stack([runs, scales], axis=1).reshape(-1, 11)
    g.out.run_rows(runs)
    g.out.explain.extend(np.stack([one * b.tensor, one * o, one * stg, rank, region,
                                   one * b.numel * es_d], axis=1))
    return True
