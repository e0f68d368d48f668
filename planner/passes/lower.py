"""Pass 7 (`lower`): chunks with a chosen source -> byte-level writes, packs and unpacks.

Each chunk is a 2-d box `size0 x size1` that starts at element `start` with strides
`(a0, a1)` on each side (a box with size1 == 1 is re-read as `1 x size0`, so columns of
1-d pieces are runs too). A chunk becomes either:
- direct writes: one per row (or one if both sides are contiguous); needs equal dtypes
  and unit inner strides on both sides; or
- staged: a PACK (strided gather, and the cast when dtypes differ) into the source's
  staging, one write, and an UNPACK out of the target's staging where the target box is
  strided. Either side skips its copy when its box is contiguous and needs no cast.
The cost model (options: write overhead, pack overhead and throughput) picks the cheaper,
chunk by chunk; `balance` then moves whole copy ops over NVLink to row writes where a
rank's copies would outlast its links. Direct writes go in stage 0 when staged chunks are
packed, and in a last stage of their own when they are only unpacked (`direct_stage`);
staged chunks are placed in stages so that no rank's staging exceeds its budget
(`budget.budgets`: sources up to `staging_bytes`, targets what keeps the write window full).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from planner.passes.balance import direct_after_all
from planner.passes.budget import budgets
from planner.passes.intersect import Chunks, PieceTable, element_size
from planner.passes.lower_cols import (
    At,
    Chosen,
    Geometry,
    Placed,
    Rows,
    Writes,
    chosen,
    concat,
    copies,
    direct_rows,
    rows_per_write,
    shape,
    writes,
)
from planner.passes.staging import place_staging, staging_order
from planner.rows import unique_columns, unique_rows
from planner.topology import NVLINK_WRITE_S, Topology
from schemas.config import Options
from schemas.plan import PACK, UNPACK


@dataclass(frozen=True, slots=True)
class Lowered:
    """Writes and copies of the whole plan, as columns (ranks are plan ranks)."""

    w_src_rank: np.ndarray
    """Ranks, regions and stages as int32 (`lower`'s as int8 or int16 where every value of
    the plan fits, `_narrow_dtypes`: `merge` and `coalesce` make them int32); offsets and
    bytes as int32 where every write's end fits (`FIT`), else int64."""
    w_src_region: np.ndarray
    w_src_offset: np.ndarray
    w_dst_rank: np.ndarray
    w_dst_region: np.ndarray
    w_dst_offset: np.ndarray
    w_nbytes: np.ndarray
    w_stage: np.ndarray
    copies: dict[str, np.ndarray]
    """`schemas.plan.COPY_COLUMNS` plus `rank` (the rank that runs the copy), in the plan's
    dtypes but int64 columns as int32 where their values fit (`emit` casts them back)."""
    staging: np.ndarray
    """Staging bytes of each plan rank."""
    stages: int
    slotted: bool = False
    """The targets' staging is used in slots (stage s: slot `s % SLOTS`, `staging.place_staging`):
    a write into it waits for the SLOT_ACK of stage s - SLOTS, not the ACK of s - 1."""
    sources_slotted: int = -1
    """From this stage on (-1: none), a write into a source rank's staging (a gather's) waits
    for its SLOT_ACK of stage s - SLOTS, not its ACK of s - 1: the gather's staging in
    halves, each used by every other round of two stages (`gather_out.lowered`)."""


def merge(parts: list[Lowered | None]) -> Lowered:
    """Writes and copies of both of `parts` (the direct path's, the gather's or None);
    staging per rank is the larger (their stages differ). The list should hold the only
    references to them: it is emptied and each input column dropped as soon as its merged
    column is made (the inputs and the merged table are never held whole together)."""
    a, b = parts
    parts.clear()
    if b is None:
        assert a is not None
        return a
    assert a is not None
    staging, stages, slotted = np.maximum(a.staging, b.staging), max(a.stages, b.stages), \
        a.slotted
    sources_slotted = max(a.sources_slotted, b.sources_slotted)
    keys = [k for k in Lowered.__slots__ if k.startswith("w_")]
    wa, wb = {k: getattr(a, k) for k in keys}, {k: getattr(b, k) for k in keys}
    ca, cb = dict(a.copies), dict(b.copies)
    del a, b
    w = {k: np.concatenate([wa.pop(k), wb.pop(k)], dtype=np.int32 if k in NARROW else None)
         for k in keys}
    copies = {k: concat(ca.pop(k), cb.pop(k)) for k in list(ca)}  # constants kept
    return Lowered(**w, copies=copies, staging=staging, stages=stages, slotted=slotted,
                   sources_slotted=sources_slotted)


BLOCK = 1 << 20
"""Chunks classified (and their direct writes made) per block of this many: the pass's
temporaries are the size of a block, not of the plan."""
NARROW = ("w_src_rank", "w_src_region", "w_dst_rank", "w_dst_region", "w_stage")
"""Write columns held as int32 (ranks, regions, stages: as in the plan's tables), or, in
`lower`'s columns, narrower where they fit (`_narrow_dtypes`)."""
FIT = ("w_src_offset", "w_dst_offset", "w_nbytes")
"""Write columns `lower` makes int32 while every write it makes starts at 0 or more and
ends (offset + bytes) within int32, else int64 (`_fit`); `emit` casts them to the plan's."""


def lower(chunks: Chunks, choice: np.ndarray, src: PieceTable, dst: PieceTable,
          n_regions: np.ndarray, opts: Options, tensor_names: list[str],
          bytes_in: np.ndarray, topo: Topology) -> Lowered:
    """Direct writes and staged chunks (packs, writes, unpacks in stages) of `chunks`;
    plan ranks below `topo.sources` are source ranks (`budget.budgets`: their staging
    budget is the cap; a target's is sized from the cost model: `bytes_in` it receives in
    the whole plan, its link at `topo.nic_gbps`). Chunks are classified `BLOCK` at a time;
    `balance` takes a second look at the staged ones over NVLink; those left are placed and
    lowered together, and the direct writes made after them, a block at a time, straight
    into the plan's columns (the staged chunks' temporaries and the direct writes are never
    held together; each chunk's geometry is made once to classify it, and once more, less
    what a direct write does not read, to write it)."""
    c = chosen(chunks, choice, src, dst)
    blocks = c.blocks(BLOCK)
    staged_at = np.zeros(len(chunks), dtype=bool)  # classified once, a block at a time
    n_direct = 0  # direct writes of the blocks
    # a block's classes and direct writes, kept for the same block of the next copies of
    # alike replicas (`Chosen.at`): equal where their chosen sources have the same strides
    # and dtypes (all `shape` reads of a source)
    kind = unique_columns([src.a0, src.a1, src.dtype])[1] if c.per_copy < len(chunks) \
        else None
    seen: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, int]] = {}
    again = []  # whether each block's classes are those kept
    for b in blocks:
        a = c.at(b)
        got = None if kind is None else seen.get((a.chunk.start, a.chunk.stop))
        kinds = None if kind is None else kind[a.src]
        again.append(got is not None and np.array_equal(got[0], kinds))
        if not again[-1]:
            g = shape(c, a)
            mask = _staged_mask(g, opts)
            got = (kinds, mask, int(rows_per_write(g.s0, g.s1, g.s_a0, g.d_a0)[~mask].sum()))
            del g, mask
            if kind is not None:
                seen[a.chunk.start, a.chunk.stop] = got
        staged_at[b] = got[1]
        n_direct += got[2]
    del seen
    si = c.at(np.flatnonzero(staged_at))
    si, moved = _second_look(c, si, blocks, staged_at, opts, topo)
    first = int(len(si) < len(chunks))  # any direct chunk: see `_staged`
    st = _staged(c, si, first, n_regions, opts, tensor_names, topo.sources, bytes_in,
                 topo.nic_gbps)
    del si
    n_direct += len(moved)
    at = direct_stage(st.copies["kind"], st.stages) if n_direct else 0
    stages = max(st.stages, at + 1)
    total = n_direct + len(st.writes)
    dt = _narrow_dtypes(topo.world, n_regions, stages)
    out = Writes(**{k[2:]: np.empty(total, dtype=dt[k] if k in NARROW else np.int32
                                    if k in FIT else np.int64)
                    for k in Lowered.__slots__ if k.startswith("w_")})  # written in place,
    # in order: the blocks' direct writes, those `_second_look` moved, the staged chunks';
    # the staged and moved ones put first, each dropped once put (never held beside all
    # of `out`)
    out = _fit(out, st.writes)
    out.put(n_direct, st.writes)
    st = dataclasses.replace(st, writes=None)
    out = _fit(out, moved)
    out.put(n_direct - len(moved), moved)
    end, n_moved = 0, len(moved)
    del moved
    kept: dict[tuple[int, int], _Kept] = {}  # (one copy's blocks)
    for b, same in zip(blocks, again):
        out, end = _direct_into(out, end, c, b, np.flatnonzero(~staged_at[b]),
                                kept if kind is not None else None, same)
    del staged_at
    assert end == n_direct - n_moved
    out.stage[:n_direct] = at
    return Lowered(**out.columns(), copies=st.copies, staging=st.staging, stages=stages,
                   slotted=st.slotted)


def _narrow_dtypes(world: int, n_regions: np.ndarray, stages: int) -> dict[str, np.dtype]:
    """The dtypes of `lower`'s `NARROW` columns: the narrowest of int8, int16 and int32 that
    holds every plan rank (below `world`), every region (a rank's tensors, then its staging,
    `n_regions`) and every stage (below `stages`)."""
    most = {"rank": world - 1, "region": int(n_regions.max(initial=0)), "stage": stages - 1}
    return {k: next(np.dtype(t) for t in (np.int8, np.int16, np.int32)
                    if most[k.rsplit("_", 1)[1]] <= np.iinfo(t).max) for k in NARROW}


def direct_stage(kinds: np.ndarray, stages: int) -> int:
    """The stage of the direct writes, given the kinds of the staged chunks' copies and
    their `stages`: stage 0, before the staged chunks, when any is packed (the packs of
    stage 1 run while the direct writes are in flight, `_staged`); a stage of their own
    after the staged chunks when these are only unpacked: the targets' unpacks of the last
    staged stage then run while the direct writes are in flight (a source carries on into
    that stage, `schemas.protocol.carries`) instead of ending the transfer after every
    write has landed."""
    if (kinds == PACK).any() or not (kinds == UNPACK).any():
        return 0
    return stages


def _staged_mask(g: Geometry, opts: Options) -> np.ndarray:
    """Which chunks of `g` are staged: those no direct write can do, and those the cost
    model finds cheaper staged."""
    staged = g.staged.copy()
    # The cost model, where a direct chunk takes several writes (a chunk contiguous on
    # both sides is one direct write, never dearer than staging it).
    some = np.nonzero(~staged & ~(g.s_contig & g.d_contig))[0]
    w_us, p_us = opts.write_overhead_us, opts.pack_overhead_us
    pack_us = p_us + g.nbytes[some] * 8e-3 / opts.pack_gbps  # bytes*8/(Gb/s*1e3) = us
    staged[some] = (w_us + g.pack[some] * pack_us + g.unpack[some] * pack_us
                    < g.s0[some] * w_us)
    return staged


def _direct_into(out: Writes, at: int, c: Chosen, block: slice, rows: np.ndarray,
                 kept: dict[tuple[int, int], _Kept] | None, same: bool
                 ) -> tuple[Writes, int]:
    """Write the direct writes of chunks `rows` of `block` (not staged) into the columns
    `out` (`_fit` to them) from row `at`; returns the columns and the row after them. Only
    the geometry that `writes` reads is made, or, with `same` (the block's classes are
    those of the same block of a copy before, `lower`), taken from `kept` with the target
    offsets (a copy's target pieces are the first copy's but for their ranks); where the
    chosen sources are those of that copy's block too, its writes are that block's rows of
    `out`, their target ranks moved."""
    key = (block.start % c.per_copy, (block.start % c.per_copy) + block.stop - block.start)
    a = c.at(rows + block.start)
    got = kept.get(key) if kept is not None and same else None
    if got is not None and isinstance(a.copy, int) and a.src is not None and \
            np.array_equal(a.src, got.src):
        return out, out.repeat(got.at, at, got.n, "dst_rank",
                               (a.copy - got.copy) * c.dst.rank.step)
    if got is None:
        g = direct_rows(c, a)
        part = writes(c, g, None, a)
        if kept is not None:
            kept[key] = _Kept(g, part.dst_offset, a.src, a.copy, at, len(part))
    else:
        part = writes(c, got.rows, None, a, got.dst_offset)
    out = _fit(out, part)
    return out, out.put(at, part)


@dataclass(frozen=True, slots=True)
class _Kept:
    """What `_direct_into` keeps of a block of the first copy for the same block of the
    next copies: its direct writes' `Rows` and target offsets, the chosen sources and copy
    they were made for, and where in the plan's columns its writes are (`at`, `n` rows)."""

    rows: Rows
    dst_offset: np.ndarray
    src: np.ndarray | None
    copy: np.ndarray | int
    at: int
    n: int


def _fit(out: Writes, part: Writes) -> Writes:
    """`out`, with its `FIT` columns widened to int64 (copies) where they are int32 and a
    write of `part` starts below 0 or ends (offset + bytes) past int32's largest value."""
    if out.nbytes.dtype == np.int64 or len(part) == 0:
        return out
    lo = min(int(part.src_offset.min()), int(part.dst_offset.min()), int(part.nbytes.min()))
    hi = max(int(part.src_offset.max()), int(part.dst_offset.max())) + int(part.nbytes.max())
    if lo >= 0 and hi <= np.iinfo(np.int32).max:
        return out
    return dataclasses.replace(out, **{k[2:]: getattr(out, k[2:]).astype(np.int64)
                                       for k in FIT})


def _direct_load(c: Chosen, rows: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Source rank, target rank, bytes and number of direct writes of each chunk of `rows`
    (not staged), for the link load: what `writes` would make, without making them."""
    a = c.at(rows)
    g = direct_rows(c, a)
    n = rows_per_write(g.s0, g.s1, g.s_a0, g.d_a0)
    return c.source("rank", a), c.target("rank", a), g.s0 * g.s1 * g.es_d, n


def _second_look(c: Chosen, si: At, blocks: list[slice], staged_at: np.ndarray,
                 opts: Options, topo: Topology) -> tuple[At, Writes]:
    """The staged chunks `si` that stay staged, and the direct writes of those that
    `balance.direct_after_all` moves (the other chunks' direct writes, `~staged_at`, count
    towards the links, a block at a time, only where a staged chunk crosses NVLink)."""
    host, world = np.asarray(topo.host, dtype=np.int32), topo.world
    s_rank, d_rank = c.source("rank", si), c.target("rank", si)
    nvlink = host[s_rank] == host[d_rank]
    if not nvlink.any():
        none = si.take(slice(0, 0))
        return si, writes(c, shape(c, none), None, none)
    g = shape(c, si)
    s_reg, d_reg = c.source("region", si), c.target("region", si)
    p, u, nb = g.pack, g.unpack, g.nbytes
    # each rank's copies: one op per (rank, tensor region), and their bytes
    ops = unique_rows(np.concatenate([np.stack([s_rank[p], s_reg[p]], axis=1),
                                      np.stack([d_rank[u], d_reg[u]], axis=1)]).astype(np.int64))
    copy_s = (np.bincount(ops[:, 0], minlength=world) * opts.pack_overhead_us * 1e-6 +
              np.bincount(np.concatenate([s_rank[p], d_rank[u]]),
                          weights=np.concatenate([nb[p], nb[u]]), minlength=world)
              / (opts.pack_gbps * 1e9 / 8))
    # each rank's NVLink traffic: its bytes at its rate, its writes at NVLINK_WRITE_S each
    link_s = np.zeros(world)
    direct = (_direct_load(c, b.start + np.flatnonzero(~staged_at[b])) for b in blocks)
    for a, z, n, w in [*direct, (s_rank, d_rank, nb, np.ones(len(si), dtype=np.int64))]:
        nv = host[a] == host[z]  # (sums of whole bytes and writes: exact in float64)
        for r in (a[nv], z[nv]):
            link_s += np.bincount(r, weights=n[nv], minlength=world) / (
                topo.nvlink_gbps * 1e9 / 8) + np.bincount(r, weights=w[nv],
                                                          minlength=world) * NVLINK_WRITE_S
    one = np.flatnonzero(p ^ u)  # a pack or an unpack, not both
    pk = p[one]
    move = direct_after_all(
        np.where(pk, s_rank[one], d_rank[one]), np.where(pk, s_reg[one], d_reg[one]),
        g.s0[one], nb[one], np.where(pk, d_rank[one], s_rank[one]),
        nvlink[one] & ~g.staged[one], copy_s, link_s, opts)  # ~staged: rows can do it
    moved = one[move]
    return si.take(np.delete(np.arange(len(si)), moved)), writes(c, g, moved, si)


@dataclass(frozen=True, slots=True)
class _Staged:
    """What `_staged` makes of the staged chunks: their writes (with stages), copies,
    staging per plan rank, number of stages and slotting (`Lowered`)."""

    writes: Writes | None
    """None once `lower` has put them into the plan's columns."""
    copies: dict[str, np.ndarray]
    staging: np.ndarray
    stages: int
    slotted: bool


def _staged(c: Chosen, si: At, first: int, n_regions: np.ndarray, opts: Options,
            tensor_names: list[str], sources: int, bytes_in: np.ndarray, nic_gbps: float
            ) -> _Staged:
    """Writes, copies, staging per rank, stages and slotting of the staged chunks `si`.
    They start in stage `first`: 1 when there are direct writes (and packs): those go
    first, in stage 0, and stage 1's packs run while they are in flight
    (`schemas.protocol`). Where `si` is alike blocks of the copies of alike replicas
    (`_alike`), each column is made for the first block and read per placed chunk from it
    (its row in the block), the target ranks moved by the chunk's block."""
    world = len(n_regions)
    times = _alike(c, si)
    one = si.take(slice(0, len(si) // times)) if times > 1 else si
    del si
    step = c.dst.rank.step if times > 1 else 0
    g = shape(c, one)
    src_rank, dst_rank = c.source("rank", one), c.target("rank", one)
    row, block = staging_order(src_rank, dst_rank, g.nbytes, world, times, step)
    # every column in placement order, one at a time (each first block's column is small)
    src_rank = src_rank[row]
    dst_rank = dst_rank[row]
    if block is not None:  # (in place: the block numbers become the ranks' moves)
        block *= block.dtype.type(step)
        dst_rank += block
    del block
    cols = {f.name: getattr(g, f.name) for f in dataclasses.fields(Geometry)}
    del g
    for k in cols:  # a column of one value stays one (`constant`): no gather
        cols[k] = _placed(cols[k], row)
    g = Geometry(**cols)
    del cols
    nbytes, pack, unpack = g.nbytes, g.pack, g.unpack
    first = first if pack.any() else 0
    budget = budgets(world, sources, dst_rank[unpack], nbytes[unpack], bytes_in, opts,
                     nic_gbps)
    stage, s_soff, d_soff, staging, slotted = place_staging(
        None, src_rank, dst_rank, pack, unpack, nbytes, budget, opts,
        c.chunk("tensor", one)[row], tensor_names, world, first)
    stages = int(stage.max()) + 1 if len(stage) else 1
    # One write per chunk (in placement order, which `stage`, `s_soff` and `d_soff`
    # follow), from staging (if packed) into staging (if unpacked).
    del nbytes, pack, unpack
    at = Placed(stage=stage, s_soff=s_soff, d_soff=d_soff, src_rank=src_rank,
                dst_rank=dst_rank, s_region=c.source("region", one)[row],
                d_region=c.target("region", one)[row],
                s_start=c.start(one, source=True)[row],
                d_start=c.start(one, source=False)[row])
    del src_rank, dst_rank, one, row
    # the copies first: the geometry only they read goes before the writes are made
    cp = copies(g, at, n_regions)
    p, u, s_code, es_d, nbytes = g.pack, g.unpack, g.s_code, g.es_d, g.nbytes
    del g
    # the writes' columns one at a time, each placed column dropped once read
    src_rank, dst_rank, s_region, d_region, s_start, d_start = (
        at.src_rank, at.dst_rank, at.s_region, at.d_region, at.s_start, at.d_start)
    del at
    # (where a mask takes one side whole, the column is that side, in its own dtype: `lower`
    # puts the staged writes' columns into the plan's)
    p, u = _some(p), _some(u)
    src_region = n_regions[src_rank] if p is True else s_region if p is False else \
        np.where(p, n_regions[src_rank], s_region)
    del s_region
    src_offset = s_soff if p is True else s_start * element_size(s_code) if p is False \
        else np.where(p, s_soff, s_start * element_size(s_code))
    del s_soff, s_start, s_code
    dst_region = n_regions[dst_rank] if u is True else d_region if u is False else \
        np.where(u, n_regions[dst_rank], d_region)
    del d_region
    dst_offset = d_soff if u is True else d_start * es_d if u is False else \
        np.where(u, d_soff, d_start * es_d)
    del d_soff, d_start, es_d
    w = Writes(src_rank=src_rank, dst_rank=dst_rank, src_region=src_region,
               src_offset=src_offset, dst_region=dst_region, dst_offset=dst_offset,
               nbytes=nbytes, stage=stage)  # (the plan's columns take them as int32 etc.)
    return _Staged(w, cp, staging, stages, slotted)


def _placed(col: np.ndarray, row: np.ndarray) -> np.ndarray:
    """`col[row]`, or, where `col` is all one value, that value as a `constant` column."""
    if len(col) > 1 and (col == col[0]).all():
        return np.broadcast_to(col[:1].copy(), (len(row),))
    return col[row]


def _some(mask: np.ndarray) -> np.ndarray | bool:
    """`mask`, or True (False) where it sets every row (none)."""
    k = int(np.count_nonzero(mask))
    return mask if 0 < k < len(mask) else k > 0


def _alike(c: Chosen, si: At) -> int:
    """The number of blocks of `si` alike (1 where they are not): the copies of alike
    replicas each with the same staged chunks (their rows in the copy) and the same chosen
    source rows, so each block's geometry, source ranks and target columns but the ranks
    are the first block's."""
    times = len(c.chunks) // c.per_copy if c.per_copy else 1
    n = len(si)
    if times < 2 or n == 0 or n % times or isinstance(si.copy, int) or si.src is None:
        return 1
    m = n // times
    copy = si.copy
    if int(copy[0]) != 0 or int(copy[-1]) != times - 1 or \
            not (copy[::m] == np.arange(times)).all() or \
            not (copy[m - 1::m] == np.arange(times)).all():  # ascending: blocks of one copy
        return 1
    chunk, src = np.asarray(si.chunk).reshape(times, m), si.src.reshape(times, m)
    if not ((chunk == chunk[0]).all() and (src == src[0]).all()):
        return 1
    return times
