"""Pass 4 (`assign`): pick the source replica of every chunk.

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
from planner.topology import Topology


def split_rows(chunks: Chunks, dst: PieceTable, max_write_bytes: int) -> Chunks:
    """Cut chunks along dim 0 so that each holds at most `max_write_bytes` (>= one row)."""
    row_bytes = chunks.size1 * element_size(dst.dtype[chunks.dst])
    rows_per = np.maximum(1, max_write_bytes // row_bytes)
    parts = -(-chunks.size0 // rows_per)
    idx = np.repeat(np.arange(len(chunks)), parts)
    first = np.repeat(np.cumsum(parts) - parts, parts)
    k = np.arange(len(idx)) - first
    off0 = chunks.off0[idx] + k * rows_per[idx]
    size0 = np.minimum(rows_per[idx], chunks.off0[idx] + chunks.size0[idx] - off0)
    return Chunks(tensor=chunks.tensor[idx], off0=off0, off1=chunks.off1[idx], size0=size0,
                  size1=chunks.size1[idx], dst=chunks.dst[idx], sbox=chunks.sbox[idx],
                  holder_ptr=chunks.holder_ptr, holders=chunks.holders)


def assign(chunks: Chunks, src: PieceTable, dst: PieceTable, topo: Topology) -> np.ndarray:
    """Row of the source `PieceTable` chosen for each chunk."""
    nbytes = chunks.size0 * chunks.size1 * element_size(dst.dtype[chunks.dst])
    lo = chunks.holder_ptr[chunks.sbox]
    n_cand = chunks.holder_ptr[chunks.sbox + 1] - lo
    choice = chunks.holders[lo]  # right for single-candidate chunks
    host = np.asarray(topo.host)
    nic = np.asarray(topo.nic)
    dst_host = host[dst.rank[chunks.dst]]
    nvlink_key = int(nic.max()) + 1 + np.arange(topo.world)  # one NVLink "port" per rank
    src_rank = src.rank[choice]
    key = np.where(host[src_rank] == dst_host, nvlink_key[src_rank], nic[src_rank])
    load = np.bincount(key[n_cand == 1], weights=nbytes[n_cand == 1],
                       minlength=int(nvlink_key.max()) + 1).tolist()
    multi = np.nonzero(n_cand > 1)[0]
    if len(multi) == 0:
        return choice
    order = multi[np.argsort(-nbytes[multi], kind="stable")]
    cand_cache: dict[int, list[tuple[int, int, int, int]]] = {}
    holders, ptr = chunks.holders, chunks.holder_ptr
    src_ranks, host_l, nic_l = src.rank.tolist(), host.tolist(), nic.tolist()
    nvk = nvlink_key.tolist()
    sbox_l, dhost_l, nbytes_l = chunks.sbox.tolist(), dst_host.tolist(), nbytes.tolist()
    out = choice.copy()
    for i in order.tolist():
        sb = sbox_l[i]
        cands = cand_cache.get(sb)
        if cands is None:
            cands = [(src_ranks[h], host_l[src_ranks[h]], nic_l[src_ranks[h]], h)
                     for h in holders[ptr[sb]:ptr[sb + 1]].tolist()]
            cand_cache[sb] = cands
        dh = dhost_l[i]
        same = [c for c in cands if c[1] == dh]
        if same:
            best = min(same, key=lambda c: (load[nvk[c[0]]], c[0]))
            load[nvk[best[0]]] += nbytes_l[i]
        else:
            best = min(cands, key=lambda c: (load[c[2]], c[0]))
            load[best[2]] += nbytes_l[i]
        out[i] = best[3]
    return out

