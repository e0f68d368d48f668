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

import numpy as np

from planner.passes.intersect import Chunks, PieceTable, element_size
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
    multis = []
    for at in range(0, len(chunks), _SLICE):
        part = slice(at, at + _SLICE)
        sbox = chunks.sbox[part]
        lo = ptr[sbox]
        one = ptr[sbox + 1] - lo == 1
        choice[part] = holders[lo]  # right for single-candidate chunks
        rows = np.nonzero(one)[0] + at
        src_rank = src.rank[choice[rows]]
        key = np.where(host[src_rank] == host[dst.rank[chunks.dst[rows]]],
                       nvlink_key[src_rank], nic[src_rank])
        load_a += np.bincount(key, weights=_nbytes(chunks, dst, rows), minlength=len(load_a))
        multis.append(np.nonzero(~one)[0] + at)
    multi = np.concatenate(multis) if multis else np.zeros(0, dtype=np.int64)
    if len(multi) == 0:
        return choice
    nbytes = _nbytes(chunks, dst, multi)
    pick = stable_argsort(-nbytes)
    order, nbytes = multi[pick], nbytes[pick]
    load = load_a.tolist()
    # per (source box, target host): the candidates' load keys and holders, by rank (stable:
    # the first of the least loaded is then the lowest rank, as `min` by (load, rank) picks)
    cand_cache: dict[int, tuple[list[int], list[int]]] = {}
    hosts = int(host.max()) + 1
    src_ranks, host_l, nic_l = src.rank.tolist(), host.tolist(), nic.tolist()
    nvk = nvlink_key.tolist()
    sbox = chunks.sbox[order].astype(np.int64)
    dst_host = host[dst.rank[chunks.dst[order]]]
    picked = []
    get, put, least = cand_cache.get, picked.append, load.__getitem__
    for at, nb in zip((sbox * hosts + dst_host).tolist(), nbytes.tolist()):
        cands = get(at)
        if cands is None:
            sb, dh = divmod(at, hosts)
            cands = cand_cache[at] = _candidates(
                holders[ptr[sb]:ptr[sb + 1]].tolist(), dh, src_ranks, host_l, nic_l, nvk)
        keys, row_of = cands
        k = min(keys, key=least)  # the first of the least loaded
        load[k] += nb
        put(row_of[k])
    choice[order] = picked
    return choice


def _candidates(rows: list[int], dh: int, src_ranks: list[int], host: list[int],
                nic: list[int], nvk: list[int]) -> tuple[list[int], dict[int, int]]:
    """The candidates of a chunk whose target is on host `dh`, among the source rows `rows`
    holding its box: those on `dh` if any (their NVLink keys), else all (their NICs); as
    (load keys, ordered by rank; the row of each key's first candidate, lowest rank)."""
    same = [h for h in rows if host[src_ranks[h]] == dh]
    rows = sorted(same or rows, key=lambda h: src_ranks[h])
    keys = [nvk[src_ranks[h]] if same else nic[src_ranks[h]] for h in rows]
    row_of: dict[int, int] = {}
    for k, h in zip(keys, rows):
        row_of.setdefault(k, h)
    return keys, row_of


def _nbytes(chunks: Chunks, dst: PieceTable, rows: np.ndarray) -> np.ndarray:
    return chunks.size0[rows] * chunks.size1[rows] * element_size(dst.dtype[chunks.dst[rows]])

