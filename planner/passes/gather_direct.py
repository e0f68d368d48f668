"""The gather pass's boxes QUANT reads in place, as columns (`gather.py`, `add_direct`).

A target box that one source rank holds whole, in one piece, and that the targets take in
FP8 needs no gather: its owner is that rank, one QUANT reads the piece in place into the
owner's staging, and the owner writes the e4m3 box and its scales to every target rank
holding it. `order` puts those boxes first (only one source can own them), so they are
done here for the whole prefix of such boxes at once: the same rows, in the same order,
as `Gatherer.add` box by box. Only the staging rounds are chosen box by box (each owner's
next-fit, a few integer operations a box); the copies, writes, scales and NIC loads are
columns. A box this cannot do (staging too small, a transposed target, no scale piece)
ends the prefix: `add` does it, and raises.
"""

from __future__ import annotations

import numpy as np

from planner.passes.gather_box import GatherState
from schemas.plan import QUANT
from schemas.protocol import ALIGN, FP8_CODE, scale_blocks
from schemas.protocol import FP8_BLOCK as BLOCK


def add_direct(g: GatherState, order: np.ndarray) -> int:
    """Do the leading boxes of `order` that QUANT reads in place; returns how many."""
    ch, w, s = g.chunks, g.w, g.s
    t = order
    c = g.chunk_ptr[t].clip(max=max(len(ch) - 1, 0))
    sb = ch.sbox[c] if len(ch) else np.zeros(len(t), dtype=np.int64)
    one = (np.diff(g.chunk_ptr)[t] == 1) & (np.diff(ch.holder_ptr)[sb] == 1) \
        & (w.dtype[g.first[t]] == FP8_CODE)
    h = ch.holders[ch.holder_ptr[sb]].astype(np.int64)
    tensor, t0, t1, n0, n1 = (g.tboxes[t, k] for k in range(5))
    need = _align(n0 * n1) + _align(scale_blocks(n0, n1) * 4)
    one &= need <= g.alloc.caps[0]
    # the targets of each box, in `add`'s order
    n_to = g.target_ptr[t + 1] - g.target_ptr[t]
    box = np.repeat(np.arange(len(t)), n_to)
    i = g.targets_of[np.repeat(g.target_ptr[t], n_to) + _within(n_to)]
    j = g.scale_j[i]
    bad = ((w.a1[i] != 1) & (n1[box] > 1)) | (j < 0)
    one &= np.bincount(box, weights=bad, minlength=len(t)) == 0
    n = int(np.argmin(one)) if not one.all() else len(t)
    if n == 0:
        return 0
    keep = box < n
    t, c, h, tensor, t0, t1, n0, n1, need = (x[:n] for x in (t, c, h, tensor, t0, t1, n0,
                                                               n1, need))
    box, i, j = box[keep], i[keep], j[keep]
    src = g.src_rows(h)
    owner = src.rank
    stg = g.n_regions[owner].astype(np.int64)
    start, k = _rounds(g, owner.tolist(), need.tolist())
    convert = g.base + 2 * k + 1
    numel = n0 * n1
    fi = g.targets_of[g.target_ptr[t]]  # each box's first target: where it lands there
    at = np.stack([w.rank[fi], w.region[fi], w.base[fi] + t0 * w.a0[fi] + t1 * w.a1[fi]])
    start, s_off = values_first(owner, k, at, start, _align(numel), need - _align(numel))
    # the NIC loads and bounds `_account` keeps
    remote = np.bincount(box, weights=g.host_a[w.rank[i]] != g.host_a[owner[box]],
                         minlength=n).astype(np.int64)
    remote *= numel
    np.add.at(g.load, g.nic_a[owner], remote)
    np.add.at(g.owner_only, owner, remote)
    np.add.at(g.fanout, owner, numel * n_to[:n])
    g.unit_max = max(g.unit_max, int((numel * n_to[:n]).max()))
    g.max_stage = max(g.max_stage, int(convert.max()))
    # one QUANT a box, read in place: with halves in its round's gather stage, so that it
    # runs early, during the round before's fan-out (`gather.py`)
    code = src.dtype
    read = src.base + t0 * src.a0 + t1 * src.a1
    ones = np.ones(n, dtype=np.int64)
    quant_at = convert - 1 if g.alloc.halves else convert
    g.out.copies.extend(np.stack([owner, ones * QUANT, quant_at, src.region, code, read,
                                 src.a0, src.a1, ones, stg, ones * FP8_CODE, start,
                                 n1, ones, ones, n0, n1, ones, s_off // 4], axis=1))
    # per target: the values, then the scales (`Out.runs` rows: several writes or one),
    # `ROWS` targets at a time (the rows a block makes are its only temporaries)
    for lo in range(0, len(i), ROWS):
        at = slice(lo, lo + ROWS)
        bx, ii, jj = box[at], i[at], j[at]
        d_rank, d_reg = w.rank[ii], w.region[ii]
        o, st, cv, b0, b1 = owner[bx], stg[bx], convert[bx], t0[bx], t1[bx]
        m0, m1 = n0[bx], n1[bx]
        rb, cb = -(-m0 // BLOCK), -(-m1 // BLOCK)
        sd = s.base[jj] + (b0 // BLOCK) * s.a0[jj] + (b1 // BLOCK) * s.a1[jj]
        d_off = w.base[ii] + b0 * w.a0[ii] + b1 * w.a1[ii]
        if ((m0 == 1) | (w.a0[ii] == m1)).all() and ((rb == 1) | (s.a0[jj] == cb)).all():
            # every run one write (dense rows): the values' and scales' writes made in
            # place, alternating, in the writes' own rows (`Out.runs`' rule)
            out = g.out.writes.claim(2 * len(ii)).reshape(len(ii), 2, 8)
            for k, (v, sc) in enumerate(((o, o), (st, st), (start[bx], s_off[bx]),
                                         (d_rank, d_rank), (d_reg, s.region[jj]),
                                         (d_off, sd * 4), (m0 * m1, rb * cb * 4), (cv, cv))):
                out[:, 0, k], out[:, 1, k] = v, sc
            del out
            _explain(g, tensor[bx], o, st, d_rank, d_reg, numel[bx])
            continue
        values = np.stack([o, st, start[bx], d_rank, d_reg, d_off, m0, m1, m1, w.a0[ii], cv],
                          axis=1)
        scales = np.stack([o, st, s_off[bx], d_rank, s.region[jj], sd * 4, rb, cb * 4,
                           cb * 4, s.a0[jj] * 4, cv], axis=1)
        g.out.run_rows(np.stack([values, scales], axis=1).reshape(-1, 11))
        del values, scales
        _explain(g, tensor[bx], o, st, d_rank, d_reg, numel[bx])
    return n


def _explain(g: GatherState, *cols: np.ndarray) -> None:
    """Explain rows (`Out.explain`'s columns), made in place."""
    out = g.out.explain.claim(len(cols[0]))
    for k, col in enumerate(cols):
        out[:, k] = col


ROWS = 1 << 16
"""Targets whose writes `add_direct` makes at a time."""


def _rounds(g: GatherState, owners: list[int], needs: list[int]) -> tuple[np.ndarray,
                                                                        np.ndarray]:
    """Each box's byte offset and round in its owner's staging (`Gatherer._place`: the
    owner's first round from the last it used whose two stages have room). An owner's
    current round and its level (where both its stages are used to) are kept as two ints
    while its boxes come, and put into the staging's table when the owner moves on and
    at the end (not two keys made and set a box)."""
    used, peak, rounds = g.alloc.used, g.alloc.peak0, g.rounds
    cap, base = g.alloc.caps[0], g.base
    get = used.get

    def level_of(owner: int, k: int) -> int:
        return max(get((owner, base + 2 * k, 0), 0), get((owner, base + 2 * k + 1, 0), 0))

    at: dict[int, list[int]] = {}  # owner -> [round, level, placed in it]
    starts, ks = [], []
    for owner, need in zip(owners, needs):
        cur = at.get(owner)
        if cur is None:
            k = rounds.get(owner, 0)
            cur = at[owner] = [k, level_of(owner, k), 0]
        k, start = cur[0], cur[1]
        if start + need > cap:
            if cur[2]:  # (the round it leaves)
                used[(owner, base + 2 * k, 0)] = used[(owner, base + 2 * k + 1, 0)] = start
                peak[owner] = max(peak[owner], start)
            while True:
                k += 1
                start = level_of(owner, k)
                if start + need <= cap:
                    break
            cur[0] = k
        cur[1], cur[2] = start + need, 1
        starts.append(start)
        ks.append(k)
    for owner, (k, level, placed) in at.items():
        rounds[owner] = k
        if placed:
            used[(owner, base + 2 * k, 0)] = used[(owner, base + 2 * k + 1, 0)] = level
            peak[owner] = max(peak[owner], level)
    return np.array(starts, dtype=np.int64), np.array(ks, dtype=np.int64)


def values_first(owner: np.ndarray, k: np.ndarray, where: np.ndarray, start: np.ndarray,
                 v_bytes: np.ndarray, s_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each box's e4m3 offset and scales offset in its owner's staging, where the boxes of
    one (owner, round `k`), laid one after another from `start` as [values, scales] pairs
    (`v_bytes`, `s_bytes` each, aligned), are laid out instead as every box's values, then
    every box's scales, each in the order of `where` (per box: where its first target
    takes it, as rank, region, element): the same bytes of the round, so that boxes
    adjacent in a target tensor (an MoE's experts) are adjacent in staging too, and
    `coalesce` merges their writes (and their scales') into a few large ones instead of
    two small ones a box (where the w1, w3 and w2 boxes of an expert alternate)."""
    n = len(start)
    if not n:
        return start, start + v_bytes
    order = np.lexsort((np.arange(n), *where[::-1], k, owner))  # (owner, round), targets
    key_o, key_k = owner[order], k[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (key_o[1:] != key_o[:-1]) | (key_k[1:] != key_k[:-1])
    grp = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    lo = np.minimum.reduceat(start[order], first)  # bump allocation: where the group starts
    v, s = v_bytes[order], s_bytes[order]
    v_end, s_end = np.cumsum(v), np.cumsum(s)
    v_before = v_end - v - (v_end - v)[first][grp]  # values of the group's earlier boxes
    s_before = s_end - s - (s_end - s)[first][grp]
    v_total = np.add.reduceat(v, first)
    out_v, out_s = np.empty_like(start), np.empty_like(start)
    out_v[order] = lo[grp] + v_before
    out_s[order] = lo[grp] + v_total[grp] + s_before
    return out_v, out_s


def _align(n: np.ndarray) -> np.ndarray:
    return -(-n // ALIGN) * ALIGN


def _within(counts: np.ndarray) -> np.ndarray:
    """0..count-1 for each count, concatenated."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
