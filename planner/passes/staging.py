"""Where `lower`'s staged chunks go: their order, stage and staging offsets.

`staging_order` sorts the staged chunks for placement (runs of them, made once for alike
blocks of them); `place_staging` gives each its stage and the offsets of its bytes in its
ranks' staging, first fit in that order; `slot_bases` sizes each rank's slots from what
they hold.

First fit in order, per chunk: a chunk uses its source's staging when packed and its
target's when unpacked; it goes into the first stage (from the latest stage either of its
ranks has reached on) where it fits in both, after what is already there (aligned). A
rank's stages only move forward, so its state is one stage and the bytes used in it, and a
chunk that uses one rank only is a step of a next fit over that rank's own chunks: its
stage breaks come from a binary search on running byte sums. Only chunks that use two
ranks (packed and unpacked) tie the ranks' sequences together; they are taken in order.
The loop runs once per stage break and per such chunk, never per chunk.
"""

from __future__ import annotations

import numpy as np

from planner.rows import lexorder
from schemas.config import ConfigError, Options
from schemas.protocol import ALIGN, SLOTS

QUANTUM = 64 << 20
"""Bytes of one (source, target) pair that go into staging before the next target's turn."""


def staging_order(src_rank: np.ndarray, dst_rank: np.ndarray, nbytes: np.ndarray,
                  world: int, copies: int = 1, step: int = 0
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """Staged chunks in placement order: every source takes its targets in turn, in
    `QUANTUM`-byte slices, starting from a target rotated by the source, so each stage
    spreads over the targets instead of all sources filling it with the same tensors
    (and hence the same few targets: incast).

    The columns are the chunks' (one row each); with `copies` > 1 they are those of the
    first of `copies` alike blocks of chunks: block k's row i is row i but for its target
    rank, moved by `k * step` (alike replicas). Returns each placed chunk's row in the
    columns (np.intp) and its block (int32; None with one block): chunk `block * rows +
    row` of the whole. Each block's (source, target) pairs, byte slices and runs are made
    once, on its rows, where the blocks' target ranks are apart (no pair in two blocks:
    the placement of the whole is then one of runs, not of chunks)."""
    n = len(src_rank)
    if copies > 1 and n and not _apart(dst_rank, copies, step):
        d = np.concatenate([dst_rank + dst_rank.dtype.type(k * step) for k in range(copies)])
        rows, _ = staging_order(np.tile(src_rank, copies), d, np.tile(nbytes, copies), world)
        del d
        return rows % n, (rows // n).astype(np.int32)
    if n == 0:
        return np.zeros(0, dtype=np.intp), None if copies <= 1 else np.zeros(0, np.int32)
    s, d = src_rank, dst_rank
    pair = lexorder(d, s)  # stable: ties in chunk order
    nb = nbytes[pair]
    new = np.ones(n, dtype=bool)
    sp, dp = s[pair], d[pair]
    new[1:] = (sp[1:] != sp[:-1]) | (dp[1:] != dp[:-1])
    start = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    before = np.cumsum(nb) - nb
    quantum = (before - before[start]) // QUANTUM  # in `pair` order
    del before, start, nb
    # The chunks by (quantum, rotated target, source), stable: in `pair` order a (source,
    # target) pair's chunks are one run, in chunk order, their quanta ascending, so each
    # (source, target, quantum) is a run of its own, and no two runs have equal keys (the
    # source and its rotation give the target): the runs are sorted, not the chunks; a
    # block's runs are the first block's, their targets moved.
    new[1:] |= quantum[1:] != quantum[:-1]
    run = np.flatnonzero(new)
    del new
    rs, rd, rq = sp[run], dp[run], quantum[run]
    del sp, dp, quantum
    length = np.diff(np.append(run, n))
    k = max(copies, 1)
    if k > 1:
        rs, rq, run, length = (np.tile(x, k) for x in (rs, rq, run, length))
        rd = np.concatenate([rd + rd.dtype.type(j * step) for j in range(k)])
    runs = lexorder(rs, (rd + rs) % max(world, 1), rq)
    length = length[runs]
    at = np.repeat(run[runs] - (np.cumsum(length) - length), length)
    at += np.arange(k * n)
    rows = pair[at].astype(np.intp, copy=False)
    del at
    if k == 1:
        return rows, None
    block = np.repeat((runs // (len(runs) // k)).astype(np.int32), length)
    return rows, block


def _apart(dst_rank: np.ndarray, copies: int, step: int) -> bool:
    """Whether blocks of `dst_rank`, each the first plus `k * step` (k < `copies`), share
    no target rank: the step is larger than the first block's span of ranks."""
    return abs(step) > int(dst_rank.max()) - int(dst_rank.min())


def place_staging(si: np.ndarray | None, src_rank: np.ndarray, dst_rank: np.ndarray,
                  pack: np.ndarray, unpack: np.ndarray, nbytes: np.ndarray,
                  budget: np.ndarray, opts: Options, tensor: np.ndarray,
                  tensor_names: list[str], world: int, first: int = 0
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """Stage (from `first` on, int32) and staging offsets of each staged chunk `si` (in placement
    order; None: the columns are the chunks', in placement order): the first stage where
    both ends fit; each rank's staging bytes; and whether stages use slots.

    Stage s uses slot `s % SLOTS` of the rank's staging, so the packs of stage s+1 never
    touch what stages s and s-1 read and may run while their writes are in flight
    (`schemas.protocol`); a stage fills at most a third of the rank's `budget`, and each
    slot of a rank is as large as the most one of its stages puts there (`slot_bases`): the
    budget is a cap, not an allocation. When a chunk is larger than a third of a budget it
    uses, every stage uses all of each rank's budget (and packs in order)."""
    cap_bytes = opts.staging_bytes
    n = len(nbytes) if si is None else len(si)
    if n == 0:
        zero = np.zeros(0, dtype=np.int64)
        return zero.astype(np.int32), zero, zero.copy(), np.zeros(world, dtype=np.int64), \
            False
    def take(col: np.ndarray) -> np.ndarray:
        return col if si is None else col[si]

    nb = take(nbytes).astype(np.int64, copy=False)  # (read only)
    big = nb > cap_bytes
    if big.any():
        i = int(np.argmax(big)) if si is None else si[np.argmax(big)]
        why = "a cast or strided pack" if cap_bytes else "staging (a cast, or a strided box)"
        raise ConfigError(
            f"options.staging_bytes: {cap_bytes} is too small: {tensor_names[tensor[i]]} needs "
            f"{why} of {int(nbytes[i])} bytes; raise options.staging_bytes to at least "
            f"{int(nbytes[i])} or lower options.max_write_bytes")
    p, u = take(pack), take(unpack)
    sr, dr = take(src_rank), take(dst_rank)
    n_p, n_u = int(np.count_nonzero(p)), int(np.count_nonzero(u))
    # One "use" per (chunk, rank whose staging it takes): packed on its source, unpacked on
    # its target (packs first); grouped by rank, in placement order within a rank.
    rows_p = slice(None) if n_p == n else np.flatnonzero(p)
    rows_u = slice(None) if n_u == n else np.flatnonzero(u)
    use_rank = sr[rows_p] if not n_u else dr[rows_u] if not n_p else \
        np.concatenate([sr[rows_p], dr[rows_u]])
    # stable: a rank's uses are all packs (a source) or all unpacks (a target), in order
    by_rank = np.argsort(use_rank.astype(np.uint16) if world <= 1 << 16 else use_rank,
                         kind="stable")
    use_rank = use_rank[by_rank]
    if not n_u and n_p == n or not n_p and n_u == n:
        use_chunk = by_rank  # use k is chunk k
    else:
        use_chunk = np.concatenate([_index(rows_p, n), _index(rows_u, n)])[by_rank]
    is_src = by_rank < n_p if n_p and n_u else None  # (None: every use is of one side)
    del by_rank  # (each temporary goes once read: these are a few of the chunks' size)
    use_nb = nb[use_chunk]
    del nb
    third = budget // SLOTS // ALIGN * ALIGN
    lo = np.searchsorted(use_rank, np.arange(world), side="left")
    hi = np.searchsorted(use_rank, np.arange(world), side="right")
    used = np.flatnonzero(hi > lo)
    largest = np.maximum.reduceat(use_nb, lo[used]) if len(used) else use_nb[:0]
    slots = bool((third[used] >= largest).all() and (third[used] > 0).all())
    cap = third if slots else budget
    buf = np.negative(use_nb)  # each use's bytes aligned, then its end (one buffer)
    buf //= ALIGN
    buf *= -ALIGN
    before = np.cumsum(buf)
    before -= buf
    np.add(before, use_nb, out=buf)
    both = p & u if n_p and n_u else None
    cuts, cut_stage = _next_fit(use_chunk, use_rank, use_nb, before, buf, cap, both, lo,
                                hi, first)
    # the (rank, stage) runs of uses, those of one use or more (cuts may repeat)
    run = np.flatnonzero(np.diff(cuts, append=len(use_rank)))
    cuts, cut_stage = cuts[run], cut_stage[run]
    last = np.append(cuts, len(use_rank))[1:] - 1
    # each use's offset from its stage's start, and its end: within a run the ends ascend,
    # so its last use ends it
    off = before
    off -= _spread(before[cuts], cuts, buf)
    run_rank, run_slot = use_rank[last], cut_stage % SLOTS if slots else 0 * last
    base, staging = slot_bases(run_rank, run_slot, off[last] + use_nb[last], world)
    del use_nb, use_rank, last
    off += _spread(base[run_rank, run_slot], cuts, buf)  # from its rank's staging start
    del run_rank, run_slot
    stage = np.full(n, first, dtype=np.int32)
    stage[use_chunk] = _spread(cut_stage, cuts, buf)
    del buf
    s_off = np.zeros(n, dtype=np.int64)
    d_off = np.zeros(n, dtype=np.int64)
    if is_src is None:
        (s_off if n_p else d_off)[use_chunk] = off
    else:
        s_off[use_chunk[is_src]] = off[is_src]
        d_off[use_chunk[~is_src]] = off[~is_src]
    return stage, s_off, d_off, staging, slots


def _spread(values: np.ndarray, cuts: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`out` (int64), each of its rows set to the value of the run it lies in (run k starts
    at `cuts[k]`, ascending, the first at 0): `np.repeat` into a buffer of its own."""
    out.fill(0)
    out[cuts] = np.diff(values, prepend=0)
    return np.cumsum(out, out=out)


def _index(rows: np.ndarray | slice, n: int) -> np.ndarray:
    """`rows` (an index array, or a slice of all `n`) as an index array."""
    return np.arange(n) if isinstance(rows, slice) else rows


def _next_fit(use_chunk: np.ndarray, use_rank: np.ndarray, use_nb: np.ndarray,
              before: np.ndarray, ends: np.ndarray, cap: np.ndarray,
              both: np.ndarray | None, lo: np.ndarray, hi: np.ndarray, first: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """Where each (rank, stage) run of uses (grouped by rank) starts, ascending, and its
    stage (`before`: aligned bytes of the uses ahead of it, summed over all ranks, and
    `ends`: that plus its bytes; `both`:
    per chunk, whether it uses two ranks, None where none does; `lo`, `hi`: each rank's
    uses)."""
    world = len(lo)
    lo, hi = lo.tolist(), hi.tolist()
    at = before  # a use fits while its end - its stage's start <= cap
    caps = cap.tolist()
    cut_at: list[int] = []
    cut_stage: list[int] = []
    pos, stage, start = list(lo), [first] * world, [0] * world
    for r in range(world):
        if lo[r] < hi[r]:
            cut_at.append(lo[r])
            cut_stage.append(first)
            start[r] = int(at[lo[r]])

    def advance(r: int, upto: int) -> None:
        q, st, s0, limit = pos[r], stage[r], start[r], caps[r]
        while q < upto:
            q += int(np.searchsorted(ends[q:upto], s0 + limit, side="right"))
            if q >= upto:
                break
            st, s0 = st + 1, int(at[q])
            cut_at.append(q)
            cut_stage.append(st)
            q += 1
        pos[r], stage[r], start[r] = upto, st, s0

    # Chunks that use two ranks, in placement order, as (use on one rank, use on the other).
    two = np.nonzero(both[use_chunk])[0] if both is not None and both.any() else \
        np.zeros(0, dtype=np.int64)
    two = two[np.lexsort((use_rank[two], use_chunk[two]))].reshape(-1, 2)
    at, nbs = (at.tolist(), use_nb.tolist()) if len(two) else (at, use_nb)
    for ua, ub in two.tolist():
        a, b = int(use_rank[ua]), int(use_rank[ub])
        advance(a, ua)
        advance(b, ub)
        s = max(stage[a], stage[b])
        fill_a = at[ua] - start[a] if stage[a] == s else 0
        fill_b = at[ub] - start[b] if stage[b] == s else 0
        if fill_a + nbs[ua] > caps[a] or fill_b + nbs[ub] > caps[b]:
            s += 1
        for r, x in ((a, ua), (b, ub)):
            if stage[r] != s:
                stage[r], start[r] = s, at[x]
                cut_at.append(x)
                cut_stage.append(s)
            pos[r] = x + 1
    for r in range(world):
        advance(r, hi[r])
    cuts = np.asarray(cut_at, dtype=np.int64)
    order = np.argsort(cuts, kind="stable")
    return cuts[order], np.asarray(cut_stage, dtype=np.int64)[order]


def slot_bases(rank: np.ndarray, slot: np.ndarray, end: np.ndarray, world: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Where each rank's slots start (`[world, SLOTS]`) and its staging bytes, from the end
    (bytes from its slot's start) of every buffer placed there: slot k is as large as its
    largest end, aligned, and starts where slot k-1 ends; the staging ends at the last
    byte used."""
    size = np.zeros((world, SLOTS), dtype=np.int64)
    np.maximum.at(size, (rank, slot), end)
    base = np.cumsum(-(-size // ALIGN) * ALIGN, axis=1) - -(-size // ALIGN) * ALIGN
    staging = np.where(size > 0, base + size, 0).max(axis=1, initial=0)
    return base, staging
