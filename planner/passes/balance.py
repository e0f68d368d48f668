"""Which staged chunks over NVLink go direct after all: a rank's copies against its links.

`lower` prices each chunk on its own: staged, it costs one write and a pack or an unpack
(`pack_overhead_us` plus its bytes at `pack_gbps`); direct, `write_overhead_us` a row. Two
things that price cannot see:
- a rank runs its copies one executor op after another (the copies of one tensor region
  that agree on their geometry are one op, `schemas.plan.COPY_GROUP_KEY`; counted here as
  one op per rank and region), beside its writes: its packs during the previous stage's
  writes, its unpacks during the writes of the next stage (`lower.direct_stage`). Where
  its copies take longer than its link, they are what the transfer waits for;
- over NVLink a row costs a peer copy `NVLINK_WRITE_S` of link time (`planner/topology.py`),
  not a NIC work request and its posting: tens of nanoseconds where one kernel copies a
  batch (what `cuda_ipc` does between two GPUs), microseconds through the copy engines.

So where a rank's copies outlast its NVLink traffic, whole copy ops move to direct row
writes, the dearest op per row first, while the copies left still take at least as long as
the links the rows pass through (both ends of each row). With rows at the kernel's cost,
small plans meet this (a demo whose targets unpack tensors of half rows); at the copy
engines' a row none do; a plan of real size has links busy for milliseconds and keeps its
copies either way. Chunks over a NIC, or that
need a cast, a pack and an unpack both, or a strided row, stay staged.
"""

from __future__ import annotations

import numpy as np

from planner.rows import unique_rows
from planner.topology import NVLINK_WRITE_S
from schemas.config import Options


def direct_after_all(copy_rank: np.ndarray, region: np.ndarray, rows: np.ndarray,
                     nbytes: np.ndarray, peer: np.ndarray, movable: np.ndarray,
                     copy_s: np.ndarray, link_s: np.ndarray, opts: Options,
                     row_write_s: float = NVLINK_WRITE_S) -> np.ndarray:
    """Staged chunks (`movable` of them may be written directly as `rows` row writes over
    NVLink between `copy_rank` and `peer`) that go direct: each chunk's copy runs on
    `copy_rank` into or out of its tensor `region` (its op). `copy_s`, `link_s`: per rank,
    seconds of its copies and of its NVLink traffic (bytes and writes) as planned;
    `row_write_s`: link time of one row write. Returns a mask over the chunks."""
    move = np.zeros(len(copy_rank), dtype=bool)
    if not movable.any():
        return move
    copy_s, link_s = copy_s.astype(np.float64).copy(), link_s.astype(np.float64).copy()
    ops, of = unique_rows(np.stack([copy_rank, region], axis=1).astype(np.int64),
                          return_inverse=True)
    r_of = ops[:, 0]
    op_s = opts.pack_overhead_us * 1e-6 + np.bincount(of, weights=nbytes) / (
        opts.pack_gbps * 1e9 / 8)
    row_s = np.bincount(of, weights=rows) * row_write_s
    # copies only shrink and links only grow: an op that does not fit now never will
    fits = np.bincount(of, weights=~movable, minlength=len(ops)) == 0
    fits &= copy_s[r_of] - op_s >= link_s[r_of] + row_s
    cand = np.flatnonzero(fits)
    cand = cand[np.argsort(-op_s[cand] / np.maximum(row_s[cand], 1e-12), kind="stable")]
    by_op = np.argsort(of, kind="stable")
    bounds = np.searchsorted(of[by_op], np.arange(len(ops) + 1))
    for op in cand.tolist():
        r = int(r_of[op])
        left = copy_s[r] - op_s[op]
        if link_s[r] + row_s[op] > left:
            continue
        mine = by_op[bounds[op]:bounds[op + 1]]
        peers = np.bincount(peer[mine], weights=rows[mine] * row_write_s,
                            minlength=len(link_s))
        touched = np.flatnonzero(peers)
        if len(touched) and (link_s[touched] + peers[touched]).max() > left:
            continue
        copy_s[r] = left
        link_s[r] += row_s[op]
        link_s += peers
        move[mine] = True
    return move
