"""Pass 6 (`assign`): pick the source replica of every chunk.

Chunks are first cut along dim 0 so none exceeds `max_write_bytes` (in target bytes):
that bounds the granularity of the balance. Then, in decreasing size (ties: chunk
order), each chunk goes to a candidate on the target's host if there is one (NVLink,
loads no NIC), else to the candidate whose NIC has sent the fewest bytes so far (ties:
lowest rank). Chunks with a single candidate are forced and counted first.

Bound (greedy list scheduling): when a chunk is assigned, its NIC's load is the least
among its candidates; so for any chunk c on NIC n with NIC m also a candidate,
load_n(before c) <= load_m(before c). In particular, where every chunk may use every
source NIC (full replication), max egress <= mean egress + max chunk, a chunk being at
most max(max_write_bytes, one row of its box). Boxes that take the gather pass are given
to their least-loaded possible owner the same way, each as one unit of its whole fan-out;
the bound then holds with the largest unit (`stats.gather_unit_max`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from planner.passes.intersect import Chunks, PieceTable, element_size
from planner.passes.lower_cols import At, Chosen, chosen
from planner.rows import stable_argsort
from planner.topology import Topology


def split_rows(chunks: Chunks, dst: PieceTable, max_write_bytes: int) -> Chunks:
    """Cut chunks along dim 0 so that each holds at most `max_write_bytes` (>= one row)."""
    if all(_within(chunks, dst, max_write_bytes, slice(lo, lo + _SLICE))
           for lo in range(0, len(chunks), _SLICE)):
        return chunks  # nothing to cut (every chunk within one part; no division)
    row_bytes = chunks.size1 * element_size(dst.dtype[chunks.dst])
    rows_per = np.maximum(1, max_write_bytes // row_bytes)
    parts = -(-chunks.size0 // rows_per)
    if parts.max() == 1:  # nothing to cut
        return chunks
    idx = np.repeat(np.arange(len(chunks)), parts)
    first = np.repeat(np.cumsum(parts) - parts, parts)
    k = np.arange(len(idx)) - first
    off0 = chunks.off0[idx] + k * rows_per[idx]
    size0 = np.minimum(rows_per[idx], chunks.off0[idx] + chunks.size0[idx] - off0)
    return Chunks(tensor=chunks.tensor[idx], off0=off0, off1=chunks.off1[idx], size0=size0,
                  size1=chunks.size1[idx], dst=chunks.dst[idx], sbox=chunks.sbox[idx],
                  holder_ptr=chunks.holder_ptr, holders=chunks.holders)


_SLICE = 1 << 21
"""Chunks whose single-candidate loads are counted (and whose bytes `split_rows` checks)
at a time (bounds the temporaries)."""


def _within(chunks: Chunks, dst: PieceTable, max_write_bytes: int, part: slice) -> bool:
    """Whether every chunk of `part` has a row and holds at most `max_write_bytes` or one
    row (`split_rows` leaves it whole)."""
    size0 = chunks.size0[part]
    row_bytes = chunks.size1[part] * element_size(dst.dtype[chunks.dst[part]])
    return bool(size0.min() >= 1 and ((size0 * row_bytes <= max_write_bytes)
                                      | (size0 == 1)).all())


def assign(chunks: Chunks, src: PieceTable, dst: PieceTable, topo: Topology) -> np.ndarray:
    """Row of the source `PieceTable` chosen for each chunk."""
    holders, ptr = chunks.holders, chunks.holder_ptr
    host = np.asarray(topo.host)
    nic = np.asarray(topo.nic)
    nvlink_key = int(nic.max()) + 1 + np.arange(topo.world)  # one NVLink "port" per rank
    load_a = np.zeros(int(nvlink_key.max()) + 1)
    choice = np.empty(len(chunks), dtype=holders.dtype)
    c = chosen(chunks, choice, src, dst)  # (each block's `choice` is set before it is read)
    first, single = holders[ptr[:-1]], np.diff(ptr) == 1  # of each source box
    alike = c.per_copy < len(chunks)  # copies of alike replicas: their blocks' chunks and
    # single candidates are the first copy's, their target ranks moved (`Chosen.at`) by
    step = int(getattr(dst.rank, "step", 0))  # a copy
    seen: dict[tuple[int, int], tuple[Any, ...]] = {}
    multis = []
    for part in c.blocks(_SLICE):
        a = c.at(part)
        got = seen.get((a.chunk.start, a.chunk.stop))
        if got is None:
            sbox = c.chunk("sbox", a).astype(np.intp)
            one = single[sbox]
            picks = first[sbox]
            rows = a.take(np.flatnonzero(one))  # the single-candidate chunks
            s_rank = src.rank[picks[one]]
            nbytes = _nbytes(c, rows).astype(np.float64)
            pairs = None if not alike else _pairs(
                s_rank, c.target("rank", At(rows.chunk, rows.dst, 0, rows.src)), nbytes)
            got = (picks, rows, np.flatnonzero(~one), s_rank, nbytes, pairs)
            del sbox, one, s_rank, nbytes
            if alike:  # (the first copy's blocks: each copy's are the same slices of it)
                seen[a.chunk.start, a.chunk.stop] = got
        picks, rows, multi, s_rank, nbytes, pairs = got
        choice[part] = picks  # right for single-candidate chunks
        if pairs is not None:  # each (source, first copy's target) pair once
            s_rank, d_rank, nbytes = pairs
            d_rank = d_rank + a.copy * step if a.copy else d_rank
        else:
            d_rank = c.target("rank", At(rows.chunk, rows.dst, a.copy, rows.src))
        load_a += np.bincount(np.where(host[s_rank] == host[d_rank], nvlink_key[s_rank],
                                       nic[s_rank]), weights=nbytes, minlength=len(load_a))
        multis.append(multi + part.start)
    multi = np.concatenate(multis) if multis else np.zeros(0, dtype=np.int64)
    if len(multi) == 0:
        return choice
    a = c.at(multi)
    nbytes = _nbytes(c, a)
    pick = stable_argsort(-nbytes)
    order, nbytes, a = multi[pick], nbytes[pick], a.take(pick)
    load = load_a.tolist()
    # per (source box, target host): the candidates' load keys and holders, by rank (stable:
    # the first of the least loaded is then the lowest rank, as `min` by (load, rank) picks)
    hosts = int(host.max()) + 1
    at = c.chunk("sbox", a).astype(np.int64) * hosts
    at += host[c.target("rank", a)]
    del a
    ats, of = np.unique(at, return_inverse=True)
    del at
    cands, row_of = _candidates(ats, hosts, holders, ptr, np.asarray(src.rank), host, nic,
                                nvlink_key)
    picked = []
    put, least = picked.append, load.__getitem__
    for keys, nb in zip(map(cands.__getitem__, of.tolist()), nbytes.tolist()):
        k = min(keys, key=least)  # the first of the least loaded
        load[k] += nb
        put(k)
    choice[order] = row_of(of, np.array(picked, dtype=np.int64))
    return choice


def _pairs(s_rank: np.ndarray, d_rank: np.ndarray, nbytes: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The distinct (source rank, target rank) pairs of single-candidate chunks with the
    bytes of each (summed: whole bytes, exact in float64, so a NIC's load is the same
    sum), by a table of the pairs (no sort); None where that table would be large. Each
    copy of alike replicas then adds its loads from the pairs, not from every chunk."""
    if len(s_rank) == 0:
        return s_rank, d_rank, nbytes
    lo = int(d_rank.min())
    span, sources = int(d_rank.max()) - lo + 1, int(s_rank.max()) + 1
    if span * sources > _PAIRS:
        return None
    key = s_rank.astype(np.int64) * span
    key += d_rank
    key -= lo
    total = np.bincount(key, weights=nbytes, minlength=span * sources)
    del key
    at = np.flatnonzero(total)  # (a pair of no bytes loads nothing)
    s, d = np.divmod(at, span)
    return s, d + lo, total[at]


_PAIRS = 1 << 22
"""The largest table of (source, target) pairs `_pairs` makes (32 MiB of float64)."""


def _candidates(ats: np.ndarray, hosts: int, holders: np.ndarray, ptr: np.ndarray,
                src_rank: np.ndarray, host: np.ndarray, nic: np.ndarray,
                nvlink_key: np.ndarray
                ) -> tuple[list[list[int]], Callable[[np.ndarray, np.ndarray], np.ndarray]]:
    """The candidates of each (source box, target host) `ats` (`sbox * hosts + host`) among
    the source rows holding the box: those on the host if any (their NVLink keys), else all
    (their NICs); as their distinct load keys, ordered by their first candidate's rank, and
    `row_of(i, key)`: the row of key `key`'s first candidate of `ats[i]` (lowest rank:
    holders of one rank in holder order), for arrays of `i` and `key`."""
    sb, dh = np.divmod(ats, hosts)
    lo = ptr[sb]
    cnt = ptr[sb + 1] - lo
    g = np.repeat(np.arange(len(ats)), cnt)  # the (box, host) of each holder row
    rows = holders[np.arange(len(g)) + np.repeat(lo - (np.cumsum(cnt) - cnt), cnt)]
    rank = src_rank[rows]
    same = host[rank] == dh[g]
    near = np.zeros(len(ats), dtype=bool)
    near[g[same]] = True
    keep = same | ~near[g]
    g, rows, rank = g[keep], rows[keep], rank[keep]
    by = np.lexsort((rank, g))  # stable: holders of one rank stay in holder order
    g, rows, rank = g[by], rows[by], rank[by]
    keys = np.where(near[g], nvlink_key[rank], nic[rank])
    # each key's first candidate of its (box, host), in order
    span = int(keys.max(initial=0)) + 1
    pair, first = np.unique(g * span + keys, return_index=True)
    row = rows[first]  # by (box, host) and key
    first.sort()
    bounds = np.searchsorted(g[first], np.arange(len(ats) + 1)).tolist()
    kl = keys[first].tolist()

    def row_of(i: np.ndarray, key: np.ndarray) -> np.ndarray:
        return row[np.searchsorted(pair, i * span + key)]

    return [kl[s:e] for s, e in zip(bounds[:-1], bounds[1:])], row_of


def _nbytes(c: Chosen, a: At) -> np.ndarray:
    """Bytes of the chunks `a` in the target's dtype."""
    return c.chunk("size0", a) * c.chunk("size1", a) * element_size(c.target("dtype", a))

