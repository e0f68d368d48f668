"""The gather pass's boxes after `gather_direct`'s prefix, decided box by box and emitted as
columns a block of boxes at a time (`gather.py`'s `gather`).

Each box's owner, staging round and pool-1 packs depend on the NIC loads, fan-out bytes and
staging the boxes before it left, so they are chosen one box after another, in `order`;
but what a box writes and copies depends only on those choices. So `add_rest` keeps the
loop to the choices: everything that does not depend on them (each box's candidate owners,
the bytes its parts send from each NIC, its far targets per candidate, its staging need)
is made first as columns over all the boxes, and a box's decision is a few integer
operations and, where a holder packs, one small array step. The copies, writes, pool-1
rows and explain rows of a block of decided boxes are then made as columns, in the order
`Gatherer.add` makes them box by box (each box's own and packed parts' PACKs, then its
conversion; its parts' writes, then each target's values and scales), so the rows are the
same, in the same order.

A box this does not cover (a chunk with several holders, one QUANT reads in place or
part by part, a transposed part or target, a missing scale piece, a staging need over
the pool, two parts a rank would pack into pool 1) ends the block: `Gatherer.add` does it
(and raises the errors).
"""

from __future__ import annotations

import numpy as np

from planner.passes.gather_box import GatherState
from schemas.plan import PACK, QUANT
from schemas.protocol import ALIGN, FP8_CODE, ITEM, scale_blocks
from schemas.protocol import FP8_BLOCK as BLOCK

ROWS = 1 << 14
"""Chunks and targets of the boxes of one slice (`add_rest`), about."""


def add_rest(g: GatherState, order: np.ndarray) -> int:
    """Gather, convert and fan out the boxes `order` (int64), one after another; returns how
    many of them were made as columns (the others by `Gatherer.add`). A slice of boxes at a
    time, of about `ROWS` chunks and targets: each slice's columns stay small (below the
    size from which the compile maps an array on its own, `collector.map_large_arrays`: their
    pages are reused, not faulted in afresh, and add nothing to the peak)."""
    if not len(order):
        return 0
    rows = (g.chunk_ptr[order + 1] - g.chunk_ptr[order] + g.target_ptr[order + 1]
            - g.target_ptr[order]).tolist()
    done, at, total = 0, 0, 0
    for b, n in enumerate(rows):
        total += n
        if total >= ROWS or b == len(rows) - 1:
            done += _add_slice(g, order[at:b + 1])
            at, total = b + 1, 0
    return done


def _add_slice(g: GatherState, order: np.ndarray) -> int:
    """`add_rest` of the boxes `order`."""
    p = _Prepared(g, order)
    ok, need, cand_ptr, cand_rank, cand_nic = p.ok, p.need, p.cand_ptr, p.cand_rank, \
        p.cand_nic
    far_of, grp_ptr, grp_nic, grp_host, grp_bytes = p.far, p.grp_ptr, p.grp_nic, \
        p.grp_host, p.grp_bytes
    wb_ptr, wb_rank, wb_need, dup = p.wb_ptr, p.wb_rank, p.wb_need, p.dup
    unit, n_to = p.unit, p.n_to
    load, fanout, nic, host = g.load, g.fanout, g.nic_a.tolist(), g.host
    alloc, rounds, base = g.alloc, g.rounds, g.base
    cap1 = alloc.caps[1]
    block, by_rows = _Block(p), 0
    for b in range(len(order)):
        if not ok[b]:
            block.emit(g)
            g.add(int(order[b]))
            block.skip(b + 1)
            by_rows += 1
            continue
        lo, hi = cand_ptr[b], cand_ptr[b + 1]
        j = lo
        if hi - lo > 1:  # `pick_owner`'s ties: least NIC load, least fan-out, lowest rank
            tie = load[cand_nic[lo:hi]]
            sel = np.flatnonzero(tie == tie.min())
            if len(sel) > 1:
                f = fanout[cand_rank[lo + sel]]
                sel = sel[f == f.min()]
            j = lo + int(sel[0])
        o = int(cand_rank[j])
        w0, w1 = wb_ptr[b], wb_ptr[b + 1]
        if w0 < w1:  # parts their holders may pack into pool 1 (`gather_parts`)
            hb = wb_rank[w0:w1]
            mine = hb != o
            hb = hb[mine]
            if dup[b] and len(set(hb.tolist())) < len(hb):
                block.emit(g)
                g.add(int(order[b]))
                block.skip(b + 1)
                by_rows += 1
                continue
        # the owner's first round from its last whose two stages have room (`_place`)
        k, start = alloc.take_round(o, base, rounds.get(o, 0), need[b])
        rounds[o] = k
        gather_stage = base + 2 * k
        if w0 < w1:
            pool = alloc.pool1_used(gather_stage)
            at = pool[hb]
            nbytes = wb_need[w0:w1][mine]
            end = at + nbytes
            fit = end <= cap1
            fh = hb[fit]
            pool[fh] = end[fit]
            alloc.peak1[fh] = np.maximum(alloc.peak1[fh], end[fit])
            block.packed(w0 + np.flatnonzero(mine)[fit], at[fit])
        # the parts' bytes on their NICs, to other hosts than the owner's; the fan-out's
        g0, g1 = grp_ptr[b], grp_ptr[b + 1]
        if g0 < g1:
            m = grp_host[g0:g1] != host[o]
            np.add.at(load, grp_nic[g0:g1][m], grp_bytes[g0:g1][m])
        load[nic[o]] += unit[b] * far_of[j]
        fanout[o] += unit[b] * n_to[b]
        block.add(b, o, j, gather_stage, start)
    block.emit(g)
    return len(order) - by_rows


class _Prepared:
    """What the choices and the rows of the boxes `order` read that no choice changes, as
    columns (per box, per candidate owner, per chunk)."""

    def __init__(self, g: GatherState, order: np.ndarray) -> None:
        ch, src, w = g.chunks, g.src, g.w
        self.order, n = order, len(order)
        lo, hi = g.chunk_ptr[order], g.chunk_ptr[order + 1]
        nch = hi - lo
        self.chunk_ptr = np.concatenate([[0], np.cumsum(nch)])
        c = np.repeat(lo, nch) + within(nch)  # the boxes' chunks, box after box
        bx = np.repeat(np.arange(n), nch)
        h = ch.holders[ch.holder_ptr[ch.sbox[c]]].astype(np.int64)  # (one holder: `ok`)
        self.c, self.h = c, h
        hr = src.rank[h].astype(np.int64)
        tb = g.tboxes[order]
        self.tb = tb
        n0, n1 = tb[:, 3], tb[:, 4]
        first = np.minimum(lo, max(len(ch) - 1, 0))
        code = src.dtype[ch.holders[ch.holder_ptr[ch.sbox[first]]]].astype(np.int64) \
            if len(ch) else np.zeros(n, dtype=np.int64)
        out = w.dtype[g.first[order]]
        es, es_d = ITEM[code].astype(np.int64), ITEM[out].astype(np.int64)
        quant = out == FP8_CODE
        cast = ~quant & (out != code)
        self.code, self.out, self.es, self.es_d, self.quant = code, out, es, es_d, quant
        # the candidate owners: the ranks holding most of the box (`pick_owner`)
        world = len(g.n_regions)
        key = bx * world + hr
        ranks, at = np.unique(key, return_inverse=True)
        held = np.bincount(at.reshape(-1), weights=(ch.size0[c] * ch.size1[c]),
                           minlength=len(ranks))
        r_box = ranks // world
        n_held = np.bincount(r_box, minlength=n)
        most = np.zeros(n)
        np.maximum.at(most, r_box, held)
        cand = held == most[r_box]
        self.cand_rank = ranks[cand] % world
        cand_box = r_box[cand]
        self.cand_ptr = np.searchsorted(cand_box, np.arange(n + 1)).tolist()
        self.cand_nic = g.nic_a[self.cand_rank]
        del key, ranks, at, held, r_box, cand
        # which boxes this covers (`Gatherer.add`'s other paths, `_place`'s error)
        multi = g.multi[order]
        direct = quant & (nch == 1)
        parts = quant & ~direct & (g.by_parts[order] | (g.aligned[order] & (n_held == 1)))
        numel = n0 * n1
        self.g_bytes = _align(numel * es)
        self.f_bytes = np.where(quant, _align(numel), np.where(cast, _align(numel * es_d), 0))
        need = self.g_bytes + self.f_bytes + np.where(quant, _align(scale_blocks(n0, n1) * 4),
                                                      0)
        a0, a1 = src.a0[h].astype(np.int64), src.a1[h].astype(np.int64)
        m0, m1 = ch.size0[c], ch.size1[c]
        rows_ok = (a1 == 1) | (m1 == 1)
        dense = rows_ok & ((m0 == 1) | (a0 == m1))
        # the targets, box after box, in `add`'s order
        n_to = g.target_ptr[order + 1] - g.target_ptr[order]
        i = g.targets_of[np.repeat(g.target_ptr[order], n_to) + within(n_to)]
        tbx = np.repeat(np.arange(n), n_to)
        self.target_ptr = np.concatenate([[0], np.cumsum(n_to)])
        self.i, self.j = i, g.scale_j[i]
        bad = ((w.a1[i] != 1) & (n1[tbx] > 1)) | (quant[tbx] & (self.j < 0))
        self.ok = (~multi & ~direct & ~parts & (nch > 0) & (need <= g.alloc.caps[0])
                   & (np.bincount(bx, weights=~rows_ok, minlength=n) == 0)
                   & (np.bincount(tbx, weights=bad, minlength=n) == 0)).tolist()
        self.need = need.tolist()
        # per candidate: its box's targets on other hosts than its own
        hosts = int(g.host_a.max()) + 1 if len(g.host_a) else 1
        t_key = np.unique(tbx * hosts + g.host_a[w.rank[i]], return_counts=True)
        want = cand_box * hosts + g.host_a[self.cand_rank]
        at = np.searchsorted(t_key[0], want).clip(max=max(len(t_key[0]) - 1, 0))
        here = np.where(t_key[0][at] == want, t_key[1][at], 0) if len(t_key[0]) else 0
        self.far = (n_to[cand_box] - here).tolist()
        # per box: the bytes its parts send from each (NIC, host) of their holders
        nics = int(g.nic_a.max()) + 1 if len(g.nic_a) else 1
        nbytes = m0 * m1 * es[bx]
        g_key, g_at = np.unique((bx * nics + g.nic_a[hr]) * hosts + g.host_a[hr],
                                return_inverse=True)
        self.grp_bytes = np.bincount(g_at.reshape(-1), weights=nbytes,
                                     minlength=len(g_key)).astype(np.int64)
        self.grp_host = g_key % hosts
        self.grp_nic = (g_key // hosts) % nics
        self.grp_ptr = np.searchsorted(g_key // hosts // nics, np.arange(n + 1)).tolist()
        # the parts a holder other than the owner packs, if pool 1 has room
        wb = ~dense & ((m1 == n1[bx]) | (m0 == 1))
        self.wb_pos = np.flatnonzero(wb)
        self.wb_rank, self.wb_need = hr[wb], _align(nbytes[wb])
        self.wb_ptr = np.searchsorted(bx[wb], np.arange(n + 1)).tolist()
        wk = np.sort(bx[wb] * world + hr[wb])  # boxes where a rank holds two such parts
        self.dup = np.isin(np.arange(n), wk[1:][wk[1:] == wk[:-1]] // world).tolist()
        self.unit = (numel * es_d).tolist()
        self.n_to = n_to.tolist()
        self.numel_d = numel * es_d
        self.sole = n_held == 1


class _Block:
    """The decided boxes whose rows are not yet emitted (a run of boxes of `order`)."""

    def __init__(self, p: _Prepared) -> None:
        self.p = p
        self.lo = self.hi = 0  # the run: boxes lo..hi - 1
        self.owner: list[int] = []
        self.cand: list[int] = []
        self.stage: list[int] = []
        self.g_off: list[int] = []
        self.packed_pos: list[np.ndarray] = []
        self.packed_off: list[np.ndarray] = []

    def add(self, b: int, owner: int, cand: int, stage: int, g_off: int) -> None:
        self.owner.append(owner)
        self.cand.append(cand)
        self.stage.append(stage)
        self.g_off.append(g_off)
        self.hi = b + 1

    def skip(self, b: int) -> None:
        """The run starts again at box `b`, once the rows before it are emitted."""
        self.lo = self.hi = b

    def packed(self, wb: np.ndarray, off: np.ndarray) -> None:
        """Parts `wb` (rows of `_Prepared.wb_pos`) packed on their holders at `off` bytes
        of pool 1."""
        if len(wb):
            self.packed_pos.append(wb)
            self.packed_off.append(off)

    def emit(self, g: GatherState) -> None:
        """The run's copies, writes, pool-1 rows and explain rows, then an empty run."""
        if self.hi > self.lo:
            _emit(g, self.p, self.lo, self.hi, self)
        self.lo = self.hi
        self.owner, self.cand, self.stage, self.g_off = [], [], [], []
        self.packed_pos, self.packed_off = [], []


def _emit(g: GatherState, p: _Prepared, lo: int, hi: int, blk: _Block) -> None:
    """`gather_rows.gather_parts`, `Gatherer._convert`, `gather_rows.fan_out` and
    `Gatherer._account`'s bounds of boxes `lo..hi - 1` of `p`, as columns: each kind of row
    made as one table, then the tables' rows put in `add`'s order by one take."""
    ch, src, w, s, out = g.chunks, g.src, g.w, g.s, g.out
    n = hi - lo
    owner = np.array(blk.owner, dtype=np.int64)
    gs = np.array(blk.stage, dtype=np.int64)
    g_off = np.array(blk.g_off, dtype=np.int64)
    stg_all = g.n_regions
    stg = stg_all[owner].astype(np.int64)
    tensor, t0, t1, n0, n1 = (p.tb[lo:hi, k] for k in range(5))
    es, es_d, quant = p.es[lo:hi], p.es_d[lo:hi], p.quant[lo:hi]
    code, out_code = p.code[lo:hi], p.out[lo:hi]
    conv = quant | (out_code != code)
    f_off = g_off + p.g_bytes[lo:hi]
    s_off = f_off + p.f_bytes[lo:hi]
    # the chunks: own (copied), packed on their holder (copied and sent), others (sent)
    c_lo, c_hi = p.chunk_ptr[lo], p.chunk_ptr[hi]
    bx = np.repeat(np.arange(n), p.chunk_ptr[lo + 1:hi + 1] - p.chunk_ptr[lo:hi])
    h = p.h[c_lo:c_hi]
    hr = src.rank[h].astype(np.int64)
    own = hr == owner[bx]
    packed = np.zeros(len(h), dtype=bool)
    off = np.zeros(len(h), dtype=np.int64)
    if blk.packed_pos:
        at = p.wb_pos[np.concatenate(blk.packed_pos)] - c_lo
        packed[at] = True
        off[at] = np.concatenate(blk.packed_off)
    copy, sent = own | packed, ~own
    n_copy = np.bincount(bx, weights=copy, minlength=n).astype(np.int64)
    n_sent = np.bincount(bx, weights=sent, minlength=n).astype(np.int64)
    conv_before = np.cumsum(conv) - conv

    def chunk_cols(at: np.ndarray) -> tuple[np.ndarray, ...]:
        c, hh, b = p.c[c_lo:c_hi][at], h[at], bx[at]
        a0, a1, region, base = (getattr(src, col)[hh].astype(np.int64, copy=False)
                                for col in ("a0", "a1", "region", "base"))
        c0, c1, m0, m1 = ch.off0[c], ch.off1[c], ch.size0[c], ch.size1[c]
        e = es[b]
        into = g_off[b] // e + (c0 - t0[b]) * n1[b] + (c1 - t1[b])
        return b, a0, a1, region, base + c0 * a0 + c1 * a1, m0, m1, e, into

    # copies: each box's own and packed parts' PACKs, then its conversion
    at = np.flatnonzero(copy)
    b, a0, a1, region, start, m0, m1, e, into = chunk_cols(at)
    mine, pk = own[at], packed[at]
    o = owner[b]
    r_copy = (np.cumsum(copy)[at] - 1) + conv_before[b]
    cv = np.flatnonzero(conv)
    r_conv = np.cumsum(n_copy)[cv] + conv_before[cv]
    table = np.empty((len(at) + len(cv), 19), dtype=np.int64)
    part, whole = table[:len(at)], table[len(at):]
    for k, col in enumerate((np.where(mine, o, hr[at]), PACK, gs[b], region, code[b], start, a0,
                             a1, 1, np.where(mine, stg[b], stg_all[hr[at]]), code[b],
                             np.where(mine, into, off[at] // e), np.where(mine, n1[b], m1), 1,
                             1, m0, m1, 1, 0)):
        part[:, k] = col
    for k, col in enumerate((owner[cv], np.where(quant[cv], QUANT, PACK), gs[cv] + 1, stg[cv],
                             code[cv], g_off[cv] // es[cv], n1[cv], 1, 1, stg[cv], out_code[cv],
                             f_off[cv] // es_d[cv], n1[cv], 1, 1, n0[cv], n1[cv], 1,
                             np.where(quant[cv], s_off[cv] // 4, 0))):
        whole[:, k] = col
    n_copies = len(out.copies)
    _in_order(table, np.concatenate([r_copy, r_conv]), out.copies.claim(len(table)))
    ci = n_copies + r_copy[pk]  # (the rows of the packed parts' PACKs)
    del table, part, whole
    # runs (`Out.runs`' rows: one write, or several): each box's sent parts, then each
    # target's values (and scales)
    ti0, ti1 = p.target_ptr[lo], p.target_ptr[hi]
    i, j = p.i[ti0:ti1], p.j[ti0:ti1]
    tbx = np.repeat(np.arange(n), p.target_ptr[lo + 1:hi + 1] - p.target_ptr[lo:hi])
    per = 1 + quant[tbx]  # rows a target takes
    n_fan = np.bincount(tbx, weights=per, minlength=n).astype(np.int64)
    at = np.flatnonzero(sent)
    b, a0, a1, region, start, m0, m1, e, into = chunk_cols(at)
    pk = packed[at]
    r_sent = (np.cumsum(sent)[at] - 1) + (np.cumsum(n_fan) - n_fan)[b]
    r_val = np.cumsum(n_sent)[tbx] + np.cumsum(per) - per
    q = np.flatnonzero(quant[tbx])
    # columns: src (rank, region, offset), dst (rank, region, offset), bytes in all, stage,
    # then rows, row bytes, src stride, dst stride
    table = np.empty((len(at) + len(i) + len(q), 12), dtype=np.int64)
    part, val, sc = table[:len(at)], table[len(at):len(at) + len(i)], table[len(at) + len(i):]
    nbytes = m0 * m1 * e
    for k, col in enumerate((hr[at], np.where(pk, stg_all[hr[at]], region),
                             np.where(pk, off[at], start * e), owner[b], stg[b], into * e,
                             nbytes, gs[b], np.where(pk, 1, m0), np.where(pk, nbytes, m1 * e),
                             np.where(pk, 0, a0 * e), np.where(pk, 0, n1[b] * e))):
        part[:, k] = col
    ed = es_d[tbx]
    d = w.base[i] + t0[tbx] * w.a0[i] + t1[tbx] * w.a1[i]
    for k, col in enumerate((owner[tbx], stg[tbx], np.where(conv, f_off, g_off)[tbx],
                             w.rank[i], w.region[i], d * ed, p.numel_d[lo:hi][tbx], gs[tbx] + 1,
                             n0[tbx], n1[tbx] * ed, n1[tbx] * ed, w.a0[i] * ed)):
        val[:, k] = col
    if len(q):
        jq, bq = j[q], tbx[q]
        rb, cb = -(-n0[bq] // BLOCK), -(-n1[bq] // BLOCK)
        sd = s.base[jq] + (t0[bq] // BLOCK) * s.a0[jq] + (t1[bq] // BLOCK) * s.a1[jq]
        for k, col in enumerate((owner[bq], stg[bq], s_off[bq], w.rank[i[q]], s.region[jq],
                                 sd * 4, rb * cb * 4, gs[bq] + 1, rb, cb * 4, cb * 4,
                                 s.a0[jq] * 4)):
            sc[:, k] = col
    r_all = np.concatenate([r_sent, r_val, r_val[q] + 1])
    one = (table[:, 8] == 1) | ((table[:, 10] == table[:, 9]) & (table[:, 11] == table[:, 9]))
    n_writes = len(out.writes)
    if one.all():  # (all one write each: put in order straight into the writes)
        _in_order(table[:, :8], r_all, out.writes.claim(len(table)))
    else:
        table = _in_order(table, r_all)
        one = _in_order(one, r_all)
        out.writes.extend(table[one, :8])
        out.strided.extend(table[~one][:, STRIDED])
    if pk.any():  # (copy, write, rank, element size) of each part packed into pool 1
        wi = n_writes + np.cumsum(one)[r_sent[pk]] - 1
        out.pool1.extend(np.stack([ci, wi, hr[at][pk], e[pk]], axis=1))
    del table, part, val, sc
    explain = np.empty((len(i), 6), dtype=np.int64)
    for k, col in enumerate((tensor[tbx], owner[tbx], stg[tbx], w.rank[i], w.region[i],
                             p.numel_d[lo:hi][tbx])):
        explain[:, k] = col
    out.explain.extend(explain)
    # the bounds `_account` keeps (the NIC loads and fan-out bytes are kept box by box)
    sole = p.sole[lo:hi]
    if sole.any():
        far = np.array([p.far[x] for x in blk.cand], dtype=np.int64)
        np.add.at(g.owner_only, owner[sole], (p.numel_d[lo:hi] * far)[sole])
    g.unit_max = max(g.unit_max, int((p.numel_d[lo:hi] * np.array(p.n_to[lo:hi])).max()))
    g.max_stage = max(g.max_stage, int(gs.max()) + 1)


STRIDED = [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 7]
"""`_emit`'s run columns in `Out.strided`'s order."""


def _in_order(table: np.ndarray, at: np.ndarray, out: np.ndarray | None = None
              ) -> np.ndarray:
    """The rows of `table` put at rows `at` (a permutation), into `out` if given (taken
    with no bounds check: numpy's checked take fills a buffer, then copies it to `out`)."""
    where = np.empty(len(at), dtype=np.int64)
    where[at] = np.arange(len(at))
    return np.take(table, where, axis=0, out=out, mode="clip")


def within(counts: np.ndarray) -> np.ndarray:
    """0..count-1 for each count, concatenated."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _align(n: np.ndarray) -> np.ndarray:
    return -(-n // ALIGN) * ALIGN
