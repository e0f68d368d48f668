"""Pass 5 (`lower`): chunks with a chosen source -> byte-level writes, packs and unpacks.

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

from dataclasses import dataclass

import numpy as np

from planner.passes.balance import direct_after_all
from planner.passes.budget import budgets
from planner.passes.intersect import Chunks, PieceTable, element_size
from planner.passes.staging import place_staging, staging_order
from planner.rows import unique_rows
from planner.simflow import NVLINK_WRITE_S
from planner.topology import Topology
from schemas.config import Options
from schemas.plan import COPY_COLUMNS, PACK, UNPACK


@dataclass(frozen=True, slots=True)
class Lowered:
    """Writes and copies of the whole plan, as columns (ranks are plan ranks)."""

    w_src_rank: np.ndarray
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


def merge(a: Lowered, b: Lowered | None) -> Lowered:
    """Writes and copies of both; staging per rank is the larger (their stages differ)."""
    if b is None:
        return a
    cat = np.concatenate
    w = {k: cat([getattr(a, k), getattr(b, k)]) for k in Lowered.__slots__
         if k.startswith("w_")}
    w = {k: v.astype(np.int32) if k in NARROW else v for k, v in w.items()}
    copies = {k: cat([a.copies[k], b.copies[k]]) for k in a.copies}
    return Lowered(**w, copies=copies, staging=np.maximum(a.staging, b.staging),
                   stages=max(a.stages, b.stages), slotted=a.slotted)


BLOCK = 1 << 20
"""Chunks classified (and their direct writes made) per block of this many: the pass's
temporaries are the size of a block, not of the plan."""
NARROW = ("w_src_rank", "w_src_region", "w_dst_rank", "w_dst_region", "w_stage")
"""Write columns held as int32 (ranks, regions, stages: as in the plan's tables)."""


def _start(t: PieceTable, rows: np.ndarray, c: Chunks, which: np.ndarray | slice
           ) -> np.ndarray:
    """Element offset of the first element of chunks `which` (rows `rows[which]` of `t`)."""
    r = rows[which]
    return t.base[r] + c.off0[which] * t.a0[r] + c.off1[which] * t.a1[r]


def _shape(chunks: Chunks, choice: np.ndarray, src: PieceTable, dst: PieceTable,
           which: np.ndarray | slice) -> dict[str, np.ndarray]:
    """Geometry and copy needs of chunks `which`: sizes and strides as 2-d boxes (`n x 1`
    read as `1 x n`), dtype codes, bytes, whether each side is contiguous, and whether
    the chunk is staged (no direct write can do it: a cast or a strided row)."""
    sr, dr = choice[which], chunks.dst[which]
    s0, s1 = chunks.size0[which], chunks.size1[which]
    col = s1 == 1  # read `n x 1` as `1 x n`
    g = {"s_a0": src.a0[sr], "d_a0": dst.a0[dr]}
    g["s_a1"] = np.where(col, g["s_a0"], src.a1[sr])
    g["d_a1"] = np.where(col, g["d_a0"], dst.a1[dr])
    g["s0"], g["s1"] = np.where(col, 1, s0), np.where(col, s0, s1)
    g["s_code"], g["d_code"] = src.dtype[sr], dst.dtype[dr]
    g["es_d"] = element_size(g["d_code"])
    g["nbytes"] = g["s0"] * g["s1"] * g["es_d"]
    one_row = g["s0"] == 1
    g["s_contig"] = (g["s_a1"] == 1) & (one_row | (g["s_a0"] == g["s1"]))
    g["d_contig"] = (g["d_a1"] == 1) & (one_row | (g["d_a0"] == g["s1"]))
    cast = g["s_code"] != g["d_code"]
    g["pack"], g["unpack"] = cast | ~g["s_contig"], ~g["d_contig"]
    g["staged"] = cast | (g["s_a1"] != 1) | (g["d_a1"] != 1)
    return g


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
    blocks = [slice(lo, lo + BLOCK) for lo in range(0, len(chunks), BLOCK)]
    staged_at = np.zeros(len(chunks), dtype=bool)  # classified once, a block at a time
    n_direct = 0  # direct writes of the blocks
    for b in blocks:
        g = _shape(chunks, choice, src, dst, b)
        staged_at[b] = mask = _staged_mask(g, opts)
        n_direct += int(_rows_per_write(g["s0"], g["s1"], g["s_a0"], g["d_a0"])[~mask].sum())
        del g, mask
    si = np.flatnonzero(staged_at)
    si, moved = _second_look(chunks, choice, src, dst, si, blocks, staged_at, opts, topo)
    sources, nic_gbps = topo.sources, topo.nic_gbps
    first = int(len(si) < len(chunks))  # any direct chunk: see `_staged`
    staged, copies, staging, stages, slotted = _staged(
        chunks, choice, src, dst, si, first, n_regions, opts, tensor_names, sources,
        bytes_in, nic_gbps)
    del si
    n_direct += len(moved["w_nbytes"])
    at = direct_stage(copies["kind"], stages) if n_direct else 0
    stages = max(stages, at + 1)
    total = n_direct + len(staged["w_nbytes"])
    out = {k: np.empty(total, dtype=np.int32 if k in NARROW else np.int64)
           for k in Lowered.__slots__ if k.startswith("w_")}  # written in place, in order:
    end = 0  # the blocks' direct writes, those `_second_look` moved, the staged chunks'
    for b in blocks:
        end = _direct_into(out, end, chunks, choice, src, dst,
                           b.start + np.flatnonzero(~staged_at[b]))
    del staged_at
    for part in (moved, staged):
        n = len(part["w_nbytes"])
        for k in list(part):
            out[k][end:end + n] = part.pop(k)
        end += n
    out["w_stage"][:n_direct] = at
    return Lowered(**out, copies=copies, staging=staging, stages=stages, slotted=slotted)


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


def _staged_mask(g: dict[str, np.ndarray], opts: Options) -> np.ndarray:
    """Which chunks of `g` (`_shape`) are staged: those no direct write can do, and those
    the cost model finds cheaper staged."""
    staged = g["staged"]
    # The cost model, where a direct chunk takes several writes (a chunk contiguous on
    # both sides is one direct write, never dearer than staging it).
    some = np.nonzero(~staged & ~(g["s_contig"] & g["d_contig"]))[0]
    w_us, p_us = opts.write_overhead_us, opts.pack_overhead_us
    pack_us = p_us + g["nbytes"][some] * 8e-3 / opts.pack_gbps  # bytes*8/(Gb/s*1e3) = us
    staged[some] = (w_us + g["pack"][some] * pack_us + g["unpack"][some] * pack_us
                    < g["s0"][some] * w_us)
    return staged


def _rows_per_write(s0: np.ndarray, s1: np.ndarray, s_a0: np.ndarray, d_a0: np.ndarray
                    ) -> np.ndarray:
    """Direct writes of each chunk (of `_shape`'s 2-d boxes): one, when both sides are
    contiguous (or it is one row), else one per row."""
    return np.where((s_a0 == s1) & (d_a0 == s1) | (s0 == 1), 1, s0)


def _direct_into(out: dict[str, np.ndarray], at: int, chunks: Chunks, choice: np.ndarray,
                 src: PieceTable, dst: PieceTable, rows: np.ndarray) -> int:
    """Write the direct writes of chunks `rows` (not staged: unit inner strides on both
    sides and no cast, so one element size) into the columns `out` from row `at`; returns
    the row after them. Only the geometry that `_writes` reads is made."""
    sr, dr = choice[rows], chunks.dst[rows]
    s0, s1 = chunks.size0[rows], chunks.size1[rows]
    col = s1 == 1  # read `n x 1` as `1 x n`
    es = element_size(dst.dtype[dr])
    g = {"s0": np.where(col, 1, s0), "s1": np.where(col, s0, s1), "s_a0": src.a0[sr],
         "d_a0": dst.a0[dr], "s_code": dst.dtype[dr], "es_d": es}
    del sr, dr, s0, s1, col
    writes = _writes(chunks, choice, src, dst, g, None, rows)
    n = len(writes["w_nbytes"])
    for k, v in writes.items():
        out[k][at:at + n] = v
    return at + n


def _direct_load(chunks: Chunks, choice: np.ndarray, src: PieceTable, dst: PieceTable,
                 rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Source rank, target rank, bytes and number of direct writes of each chunk of `rows`
    (not staged), for the link load: what `_writes` would make, without making them."""
    sr, dr = choice[rows], chunks.dst[rows]
    s0, s1 = chunks.size0[rows], chunks.size1[rows]
    col = s1 == 1  # read `n x 1` as `1 x n`
    s0, s1 = np.where(col, 1, s0), np.where(col, s0, s1)
    writes = _rows_per_write(s0, s1, src.a0[sr], dst.a0[dr])
    return src.rank[sr], dst.rank[dr], s0 * s1 * element_size(dst.dtype[dr]), writes


def _writes(chunks: Chunks, choice: np.ndarray, src: PieceTable, dst: PieceTable,
            g: dict[str, np.ndarray], di: np.ndarray | None, ids: np.ndarray
            ) -> dict[str, np.ndarray]:
    """Direct writes of the chunks `ids[di]` (`g`: `_shape` of `ids`; `di` None: all of
    them): one per row, or the whole box when both sides are contiguous."""
    sel = slice(None) if di is None else di  # (a slice takes views, not copies)
    s0, s1 = g["s0"][sel], g["s1"][sel]
    r = _rows_per_write(s0, s1, g["s_a0"][sel], g["d_a0"][sel])
    whole = r == 1  # (a chunk of rows that are not whole has more than one row)
    one = bool((r == 1).all())  # one write per chunk: no row expansion
    idx = sel if one else np.repeat(np.arange(len(ids)) if di is None else di, r)
    at = ids[idx]  # chunk index
    sr, dr = choice[at], chunks.dst[at]
    s_off, d_off = _start(src, choice, chunks, at), _start(dst, chunks.dst, chunks, at)
    if not one:  # row k of a chunk: k strides on
        k = np.arange(len(at)) - np.repeat(np.cumsum(r) - r, r)
        s_off, d_off = s_off + k * g["s_a0"][idx], d_off + k * g["d_a0"][idx]
    nbytes = np.where(whole, s0 * s1, s1) * g["es_d"][sel]
    writes = {
        "w_src_rank": src.rank[sr], "w_src_region": src.region[sr],
        "w_src_offset": s_off * element_size(g["s_code"][idx]),
        "w_dst_rank": dst.rank[dr], "w_dst_region": dst.region[dr],
        "w_dst_offset": d_off * g["es_d"][idx],
        "w_nbytes": nbytes if one else np.repeat(nbytes, r)}
    return writes  # ranks and regions in the tables' dtype: `lower` puts them in int32


def _second_look(chunks: Chunks, choice: np.ndarray, src: PieceTable, dst: PieceTable,
                 si: np.ndarray, blocks: list[slice], staged_at: np.ndarray, opts: Options,
                 topo: Topology) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The staged chunks `si` that stay staged, and the direct writes of those that
    `balance.direct_after_all` moves (the other chunks' direct writes, `~staged_at`, count
    towards the links, a block at a time, only where a staged chunk crosses NVLink)."""
    host, world = np.asarray(topo.host, dtype=np.int32), topo.world
    s_rank, d_rank = src.rank[choice[si]], dst.rank[chunks.dst[si]]
    nvlink = host[s_rank] == host[d_rank]
    if not nvlink.any():
        return si, _writes(chunks, choice, src, dst, _shape(chunks, choice, src, dst, si[:0]),
                           si[:0], si[:0])
    g = _shape(chunks, choice, src, dst, si)
    s_reg, d_reg = src.region[choice[si]], dst.region[chunks.dst[si]]
    p, u, nb = g["pack"], g["unpack"], g["nbytes"]
    # each rank's copies: one op per (rank, tensor region), and their bytes
    ops = unique_rows(np.concatenate([np.stack([s_rank[p], s_reg[p]], axis=1),
                                      np.stack([d_rank[u], d_reg[u]], axis=1)]).astype(np.int64))
    copy_s = (np.bincount(ops[:, 0], minlength=world) * opts.pack_overhead_us * 1e-6 +
              np.bincount(np.concatenate([s_rank[p], d_rank[u]]),
                          weights=np.concatenate([nb[p], nb[u]]), minlength=world)
              / (opts.pack_gbps * 1e9 / 8))
    # each rank's NVLink traffic: its bytes at its rate, its writes at NVLINK_WRITE_S each
    link_s = np.zeros(world)
    direct = (_direct_load(chunks, choice, src, dst, b.start + np.flatnonzero(~staged_at[b]))
              for b in blocks)
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
        g["s0"][one], nb[one], np.where(pk, d_rank[one], s_rank[one]),
        nvlink[one] & ~g["staged"][one], copy_s, link_s, opts)  # ~staged: rows can do it
    moved = one[move]
    return np.delete(si, moved), _writes(chunks, choice, src, dst, g, moved, si)


def _staged(chunks: Chunks, choice: np.ndarray, src: PieceTable, dst: PieceTable,
            si: np.ndarray, first: int, n_regions: np.ndarray, opts: Options,
            tensor_names: list[str], sources: int, bytes_in: np.ndarray, nic_gbps: float
            ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray, int, bool]:
    """Writes, copies, staging per rank, stages and slotting of the staged chunks `si`.
    They start in stage `first`: 1 when there are direct writes (and packs): those go
    first, in stage 0, and stage 1's packs run while they are in flight
    (`schemas.protocol`)."""
    world = len(n_regions)
    g = _shape(chunks, choice, src, dst, si)
    src_rank, dst_rank = src.rank[choice[si]], dst.rank[chunks.dst[si]]
    nbytes, pack, unpack = g["nbytes"], g["pack"], g["unpack"]
    first = first if pack.any() else 0
    order = staging_order(np.arange(len(si)), src_rank, dst_rank, nbytes, world)
    budget = budgets(world, sources, dst_rank[unpack], nbytes[unpack], bytes_in, opts,
                     nic_gbps)
    stage, s_soff, d_soff, staging, slotted = place_staging(
        order, src_rank, dst_rank, pack, unpack, nbytes, budget, opts, chunks.tensor[si],
        tensor_names, world, first)
    stages = int(stage.max()) + 1 if len(stage) else 1
    # One write per chunk (in placement order, which `stage`, `s_soff` and `d_soff`
    # follow), from staging (if packed) into staging (if unpacked).
    si = si[order]
    for k in list(g):  # one column at a time: the unordered one goes as the next is made
        g[k] = g[k][order]
    src_rank, dst_rank = src_rank[order], dst_rank[order]
    p, u = g["pack"], g["unpack"]
    s_start, d_start = _start(src, choice, chunks, si), _start(dst, chunks.dst, chunks, si)
    s_region, d_region = src.region[choice[si]], dst.region[chunks.dst[si]]
    writes = {
        "w_src_rank": src_rank, "w_dst_rank": dst_rank,
        "w_src_region": np.where(p, n_regions[src_rank], s_region),
        "w_src_offset": np.where(p, s_soff, s_start * element_size(g["s_code"])),
        "w_dst_region": np.where(u, n_regions[dst_rank], d_region),
        "w_dst_offset": np.where(u, d_soff, d_start * g["es_d"]),
        "w_nbytes": g["nbytes"], "w_stage": stage.astype(np.int32)}
    copies = _copies(p, u, stage, s_soff, d_soff, n_regions, s_start, d_start,
                     src_rank=src_rank, dst_rank=dst_rank, s_region=s_region,
                     d_region=d_region, **{k: g[k] for k in (
                         "s_code", "d_code", "es_d", "s_a0", "s_a1", "d_a0", "d_a1", "s0",
                         "s1")})
    return writes, copies, staging, stages, slotted


def _copies(p: np.ndarray, u: np.ndarray, stage: np.ndarray, s_soff: np.ndarray,
            d_soff: np.ndarray, n_regions: np.ndarray, s_start: np.ndarray,
            d_start: np.ndarray, *, src_rank: np.ndarray, dst_rank: np.ndarray,
            s_code: np.ndarray, d_code: np.ndarray, es_d: np.ndarray, s_a0: np.ndarray,
            s_a1: np.ndarray, d_a0: np.ndarray, d_a1: np.ndarray, s0: np.ndarray,
            s1: np.ndarray, s_region: np.ndarray, d_region: np.ndarray
            ) -> dict[str, np.ndarray]:
    """PACK copies (on sources) then UNPACK copies (on targets) of the staged chunks (every
    column is over the staged chunks in placement order; `p`, `u`: packed, unpacked)."""
    p, u = np.nonzero(p)[0], np.nonzero(u)[0]
    one_p, one_u = np.ones(len(p), np.int32), np.ones(len(u), np.int32)
    cols = {  # each column's (packs, unpacks), made one column at a time
        "rank": lambda: (src_rank[p], dst_rank[u]),
        "kind": lambda: (np.full(len(p), PACK), np.full(len(u), UNPACK)),
        "stage": lambda: (stage[p], stage[u]),
        "src_region": lambda: (s_region[p], n_regions[dst_rank[u]]),
        "src_dtype": lambda: (s_code[p], d_code[u]),
        "src_offset": lambda: (s_start[p], d_soff[u] // es_d[u]),
        "src_stride0": lambda: (s_a0[p], s1[u]),
        "src_stride1": lambda: (s_a1[p], one_u),
        "src_stride2": lambda: (one_p, one_u),
        "dst_region": lambda: (n_regions[src_rank[p]], d_region[u]),
        "dst_dtype": lambda: (d_code[p], d_code[u]),
        "dst_offset": lambda: (s_soff[p] // es_d[p], d_start[u]),
        "dst_stride0": lambda: (s1[p], d_a0[u]),
        "dst_stride1": lambda: (one_p, d_a1[u]),
        "dst_stride2": lambda: (one_p, one_u),
        "size0": lambda: (s0[p], s0[u]),
        "size1": lambda: (s1[p], s1[u]),
        "size2": lambda: (one_p, one_u),
        "aux_offset": lambda: (np.zeros(len(p) + len(u), dtype=np.int32),),
    }
    return {k: _column(f(), _COPY_DTYPES.get(k, np.dtype(np.int64))) for k, f in cols.items()}


def _column(parts: tuple[np.ndarray, ...], dt: np.dtype) -> np.ndarray:
    """The copy column of `parts` (packs', unpacks') in `dt`, but an int64 one as int32
    where its values fit (`_narrow`; parts all of at most 32-bit ints fit as they are)."""
    if dt == np.int64 and sum(map(len, parts)) and all(
            x.dtype.kind in "iu" and x.dtype.itemsize <= 4 and x.dtype != np.uint32
            for x in parts):
        return np.concatenate(parts, dtype=np.int32, casting="unsafe")
    return _narrow(np.concatenate(parts, dtype=dt, casting="unsafe"))


def _narrow(col: np.ndarray) -> np.ndarray:
    """An int64 copy column as int32 when its values fit (`emit` casts it back)."""
    if col.dtype != np.int64 or len(col) == 0 or col.min() < -(1 << 31) or \
            col.max() >= 1 << 31:
        return col
    return col.astype(np.int32)


_COPY_DTYPES = {"rank": np.dtype(np.int32), **{n: np.dtype(d) for n, d in COPY_COLUMNS}}
"""Copy columns as the plan holds them (narrow: kinds, dtypes, stages, regions, ranks)."""
