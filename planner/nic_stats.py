"""NIC statistics of a plan: bytes per NIC and NVLink, the bandwidth floor, the egress bound.

Writes between ranks of one host go over NVLink and load no NIC; every other write loads
its source rank's NIC (egress) and its target rank's NIC (ingress). The floor is the
busiest NIC direction (or GPU NVLink) at full bandwidth; the egress bound is what no
assignment of source replicas could beat (see `egress_bound`), so `inspect` can tell a
balance problem from a layout that cannot do better.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.passes.intersect import Chunks, PieceTable, element_size
from planner.passes.lower import Lowered
from planner.passes.lower_cols import chosen
from planner.rows import pair_sums
from planner.topology import Topology


def remote_egress(topo: Topology, low: Lowered) -> np.ndarray:
    """Bytes each NIC sends to other hosts in the writes of `low`."""
    return _sums(topo, low)[0]


def pair_bytes(topo: Topology, low: Lowered) -> tuple[np.ndarray, np.ndarray] | None:
    """The writes of `low` and their bytes per (source, target) plan rank pair
    (`rows.pair_sums`; None for a world too large for its table): what `nic_stats` and
    `emit.rank_stats` sum, tallied once for both."""
    return pair_sums(low.w_src_rank, low.w_dst_rank, low.w_nbytes, topo.world)


def _sums(topo: Topology, low: Lowered, pairs: tuple[np.ndarray, np.ndarray] | None = None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Bytes of the writes of `low` out of and into each NIC (to and from other hosts),
    and out of and into each rank over NVLink (within its host), as float64 (whole bytes:
    exact in any order): from the bytes per rank pair (`pairs`, else `pair_bytes`'), or,
    for a world too large for those, summed a block of writes at a time."""
    host, nic = np.asarray(topo.host), np.asarray(topo.nic)
    n_nics = int(nic.max()) + 1
    pairs = pair_bytes(topo, low) if pairs is None else pairs
    if pairs is not None:
        total = pairs[1]
        near = host[:, None] == host[None, :]
        remote = np.where(near, 0.0, total)
        near_b = np.where(near, total, 0.0)
        return (np.bincount(nic, weights=remote.sum(axis=1), minlength=n_nics),
                np.bincount(nic, weights=remote.sum(axis=0), minlength=n_nics),
                near_b.sum(axis=1), near_b.sum(axis=0))
    out_b, in_b = np.zeros(n_nics), np.zeros(n_nics)
    nv, nv_in = np.zeros(topo.world), np.zeros(topo.world)
    for at in range(0, len(low.w_src_rank), _BLOCK):
        part = slice(at, at + _BLOCK)
        s, d = low.w_src_rank[part], low.w_dst_rank[part]
        nbytes = low.w_nbytes[part].astype(np.float64)
        remote = host[s] != host[d]
        out_b += np.bincount(nic[s[remote]], weights=nbytes[remote], minlength=n_nics)
        in_b += np.bincount(nic[d[remote]], weights=nbytes[remote], minlength=n_nics)
        near = ~remote
        nv += np.bincount(s[near], weights=nbytes[near], minlength=topo.world)
        nv_in += np.bincount(d[near], weights=nbytes[near], minlength=topo.world)
    return out_b, in_b, nv, nv_in


_BLOCK = 1 << 21
"""Writes whose NIC and NVLink bytes are summed at a time (bounds the temporaries)."""


def nic_stats(topo: Topology, low: Lowered, bound: float,
              pairs: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, Any]:
    """`nics` (per NIC: name, host, gbps, bytes out and in), `nvlink_bytes`,
    `remote_bytes`, `floor_s` and `egress_bound_max_over_mean` (`bound` over the mean
    egress of the NICs that send). `pairs`: `pair_bytes`, when tallied already."""
    out_b, in_b, nv, nv_in = _sums(topo, low, pairs)
    nics = [{"name": topo.nic_name(n), "host": n // topo.nics_per_host,
             "gbps": topo.nic_gbps, "bytes_out": int(out_b[n]), "bytes_in": int(in_b[n])}
            for n in sorted(set(topo.nic))]
    nic_floor = max(max(out_b.max(), in_b.max()) * 8 / (topo.nic_gbps * 1e9), 0.0)
    nv_floor = max(nv.max(), nv_in.max()) * 8 / (topo.nvlink_gbps * 1e9)
    egress = [n["bytes_out"] for n in nics if n["bytes_out"]]
    return {"nics": nics, "nvlink_bytes": int(nv.sum()),
            "remote_bytes": int(out_b.sum()),
            "floor_s": float(max(nic_floor, nv_floor)),
            "egress_bound_max_over_mean": float(bound / (sum(egress) / len(egress)))
            if egress else 1.0}


def egress_sets(chunks: Chunks, src: PieceTable, dst: PieceTable, topo: Topology
                ) -> dict[tuple[int, ...], float]:
    """Bytes of the direct path's chunks of `dst` (`chunks`) per set of source NICs that hold
    them, counting only chunks with no holder on their target's host: `egress_bound`'s
    input, taken while the chunks are at hand (the compiler drops them after `lower`)."""
    host, nic = np.asarray(topo.host), np.asarray(topo.nic)
    ptr, holders = chunks.holder_ptr, chunks.holders
    n_sbox, hosts = len(ptr) - 1, max(int(host.max(initial=0)) + 1, 1)
    # each source box's set of holder NICs (once per box), and its holders' hosts
    sbox_of_holder = np.repeat(np.arange(n_sbox), np.diff(ptr))
    holder_rank = src.rank[holders[ptr[0]:ptr[-1]]] if n_sbox else np.zeros(0, np.int64)
    keys, set_of = _holder_sets(sbox_of_holder, nic[holder_rank], n_sbox)
    near = np.zeros(n_sbox * hosts, dtype=bool)  # (source box, host): a holder there
    near[sbox_of_holder * hosts + host[holder_rank]] = True
    per_id = np.zeros(len(keys))
    c = chosen(chunks, None, src, dst)  # (alike replicas' copies read through the first's)
    seen: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (one copy's blocks:
    # a copy's chunks and target pieces are the first's but for their target ranks)
    for part in c.blocks(_BLOCK):
        a = c.at(part)
        got = seen.get((a.chunk.start, a.chunk.stop))
        if got is None:
            got = (c.chunk("sbox", a), (c.chunk("size0", a) * c.chunk("size1", a) *
                                       element_size(c.target("dtype", a))).astype(np.float64))
            if c.per_copy < len(chunks):
                seen[a.chunk.start, a.chunk.stop] = got
        sbox, nbytes = got
        at = np.multiply(sbox, hosts, dtype=np.int64)
        at += host[c.target("rank", a)]
        remote = ~near[at]  # no holder on the target host
        del at
        per_id += np.bincount(set_of[sbox[remote]], minlength=len(keys), weights=nbytes[remote])
    return {k: float(per_id[i]) for k, i in keys.items() if per_id[i] > 0}


_BLOCK = 1 << 21
"""Chunks `egress_sets` reads at a time (bounds its temporaries; sums of whole bytes in
float64: exact in any order)."""


def _holder_sets(box: np.ndarray, box_nic: np.ndarray, n_box: int
                 ) -> tuple[dict[tuple[int, ...], int], np.ndarray]:
    """The distinct sets of NICs among the boxes' holders (`box_nic`: each holder's NIC,
    `box`: its box, ascending), numbered in the order the boxes first hold them, and the
    number of each box's set. Boxes whose holders share one NIC (most, in a sharded
    source) are numbered as columns; the others' sets are made in Python."""
    if n_box == 0:
        return {}, np.zeros(0, dtype=np.int64)
    order = np.lexsort((box_nic, box))
    b, n = box[order], box_nic[order].astype(np.int64)
    new = np.ones(len(b), dtype=bool)
    new[1:] = (b[1:] != b[:-1]) | (n[1:] != n[:-1])
    b, n = b[new], n[new]
    count = np.bincount(b, minlength=n_box)
    start = np.cumsum(count) - count
    one = np.flatnonzero(count == 1)
    nics, first = np.unique(n[start[one]], return_index=True)
    found = [(int(f), (int(x),)) for f, x in zip(one[first].tolist(), nics.tolist())]
    other = np.flatnonzero(count != 1)
    local: dict[tuple[int, ...], int] = {}
    other_id = []
    ns = n.tolist()
    for x, at, c in zip(other.tolist(), start[other].tolist(), count[other].tolist()):
        key = tuple(ns[at:at + c])
        k = local.get(key)
        if k is None:
            k = local[key] = len(local)
            found.append((x, key))
        other_id.append(k)
    found.sort()  # by the first box that holds each set
    keys = {key: k for k, (_, key) in enumerate(found)}
    set_of = np.empty(n_box, dtype=np.int64)
    if len(one):
        number = np.zeros(int(nics[-1]) - int(nics[0]) + 1, dtype=np.int64)
        number[nics - nics[0]] = [keys[(x,)] for x in nics.tolist()]
        set_of[one] = number[n[start[one]] - nics[0]]
    if len(other):
        by_local = [keys[key] for key in local]
        set_of[other] = np.asarray(by_local, dtype=np.int64)[other_id]
    return keys, set_of


def egress_bound(per_set: dict[tuple[int, ...], float], topo: Topology,
                 owner_only: np.ndarray) -> float:
    """A lower bound on the busiest source NIC that no assignment can beat: the bytes a
    set S of source NICs alone can send must leave through S, so some NIC of S sends at
    least bytes(S) / |S|, where bytes(S) counts what only S holds and what only one NIC of
    S holds (taken over the candidate sets that occur). `per_set`: the direct path's bytes
    per holder set (`egress_sets`); `owner_only`: bytes per plan rank of gathered boxes
    only it can own."""
    nic = np.asarray(topo.nic)
    own = np.bincount(nic[:topo.sources], weights=owner_only[:topo.sources]) \
        if topo.sources else np.zeros(0)
    bound = float(own.max()) if topo.sources else 0.0
    single = {k[0]: b for k, b in per_set.items() if len(k) == 1}
    for n, b in enumerate(own.tolist()):
        single[n] = single.get(n, 0.0) + b
    for key, b in per_set.items():  # what only S holds, and what only one NIC of S holds
        inner = sum(single.get(n, 0.0) for n in key) if len(key) > 1 else 0.0
        bound = max(bound, (b + inner) / len(key))
    return bound
