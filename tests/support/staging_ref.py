"""The first fit of `planner.passes.staging.place_staging` as a plain loop, one chunk at a
time (the compiler's own code before it was vectorised): the tests' oracle."""

from __future__ import annotations

import numpy as np

from planner.passes.budget import ALIGN
from planner.passes.staging import slot_bases
from schemas.protocol import SLOTS


def place_staging_loop(si: np.ndarray, src_rank: np.ndarray, dst_rank: np.ndarray,
                       pack: np.ndarray, unpack: np.ndarray, nbytes: np.ndarray,
                       budget: np.ndarray, world: int, first: int = 0
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """(stage, source offsets, target offsets, staging per rank, slotted) of the staged
    chunks `si`, placed one by one in order into the first stage where they fit."""
    stage = np.zeros(len(si), dtype=np.int64)
    s_off = np.zeros(len(si), dtype=np.int64)
    d_off = np.zeros(len(si), dtype=np.int64)
    if len(si) == 0:
        return stage, s_off, d_off, np.zeros(world, dtype=np.int64), False
    third = budget // SLOTS // ALIGN * ALIGN
    p_, u_ = pack[si], unpack[si]
    slots = bool((third[src_rank[si][p_]] >= nbytes[si][p_]).all()
                 and (third[dst_rank[si][u_]] >= nbytes[si][u_]).all()
                 and (third[src_rank[si][p_]] > 0).all() and (third[dst_rank[si][u_]] > 0).all())
    cap = (third if slots else budget).tolist()
    used: dict[tuple[int, int], int] = {}
    cursor = [first] * world
    sr, dr = src_rank[si].tolist(), dst_rank[si].tolist()
    pk, up, nb = pack[si].tolist(), unpack[si].tolist(), nbytes[si].tolist()
    for j in range(len(si)):
        ranks = ([sr[j]] if pk[j] else []) + ([dr[j]] if up[j] else [])
        s = max(cursor[r] for r in ranks)
        while any(used.get((r, s), 0) + nb[j] > cap[r] for r in ranks):
            s += 1
        stage[j] = s
        size = -(-nb[j] // ALIGN) * ALIGN
        for r in ranks:
            off = used.get((r, s), 0)
            if r == sr[j] and pk[j]:
                s_off[j] = off
            else:
                d_off[j] = off
            used[(r, s)] = off + size
            cursor[r] = s
    slot = stage % SLOTS if slots else np.zeros(len(si), dtype=np.int64)
    p, u = np.asarray(pk, dtype=bool), np.asarray(up, dtype=bool)
    ranks = np.concatenate([src_rank[si][p], dst_rank[si][u]])
    k = np.concatenate([slot[p], slot[u]])
    ends = np.concatenate([s_off[p], d_off[u]]) + np.concatenate([nbytes[si][p], nbytes[si][u]])
    base, staging = slot_bases(ranks, k, ends, world)
    s_off = np.where(p, s_off + base[src_rank[si], slot], s_off)
    d_off = np.where(u, d_off + base[dst_rank[si], slot], d_off)
    return stage, s_off, d_off, staging, slots
