"""Pass 5 (`lower`): chunks with a chosen source -> byte-level writes, packs and unpacks.

Each chunk is a 2-d box `size0 x size1` that starts at element `start` with strides
`(a0, a1)` on each side (a box with size1 == 1 is re-read as `1 x size0`, so columns of
1-d pieces are runs too). A chunk becomes either:
- direct writes: one per row (or one if both sides are contiguous); needs equal dtypes
  and unit inner strides on both sides; or
- staged: a PACK (strided gather, and the cast when dtypes differ) into the source's
  staging, one write, and an UNPACK out of the target's staging where the target box is
  strided. Either side skips its copy when its box is contiguous and needs no cast.
The cost model (options: write overhead, pack overhead and throughput) picks the cheaper;
staged chunks are placed in stages so that no rank's staging exceeds its budget
(`budget.budgets`: sources up to `staging_bytes`, targets what keeps the write window full).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.passes.budget import ALIGN, budgets  # noqa: F401 (ALIGN: re-exported)
from planner.passes.intersect import Chunks, PieceTable, element_size
from planner.passes.staging import place_staging, staging_order
from schemas.config import Options
from schemas.plan import PACK, UNPACK


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
    """`schemas.plan.COPY_COLUMNS` plus `rank` (the rank that runs the copy)."""
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
    copies = {k: cat([a.copies[k], b.copies[k]]) for k in a.copies}
    return Lowered(**w, copies=copies, staging=np.maximum(a.staging, b.staging),
                   stages=max(a.stages, b.stages), slotted=a.slotted)


def _start(t: PieceTable, rows: np.ndarray, c: Chunks, which: np.ndarray) -> np.ndarray:
    """Element offset of the first element of chunks `which` (rows `rows[which]` of `t`)."""
    r = rows[which]
    return t.base[r] + c.off0[which] * t.a0[r] + c.off1[which] * t.a1[r]


def lower(chunks: Chunks, choice: np.ndarray, src: PieceTable, dst: PieceTable,
          n_regions: np.ndarray, opts: Options, tensor_names: list[str], sources: int,
          bytes_in: np.ndarray, nic_gbps: float) -> Lowered:
    """Direct writes and staged chunks (packs, writes, unpacks in stages) of `chunks`;
    plan ranks below `sources` are source ranks (`budget.budgets`: their staging budget is
    the cap; a target's is sized from the cost model: `bytes_in` it receives in the whole
    plan, its link at `nic_gbps`). Columns over all chunks are only those the choice
    between direct and staged needs; the rest is computed for each kind's chunks."""
    d_row = chunks.dst
    s0, s1 = chunks.size0, chunks.size1
    col = s1 == 1  # read `n x 1` as `1 x n`
    s_a0, d_a0 = src.a0[choice], dst.a0[d_row]
    s_a1 = np.where(col, s_a0, src.a1[choice])
    d_a1 = np.where(col, d_a0, dst.a1[d_row])
    s0, s1 = np.where(col, 1, s0), np.where(col, s0, s1)
    del col
    s_code, d_code = src.dtype[choice], dst.dtype[d_row]
    es_d = element_size(d_code)
    cast = s_code != d_code
    one_row = s0 == 1
    s_contig = (s_a1 == 1) & (one_row | (s_a0 == s1))
    d_contig = (d_a1 == 1) & (one_row | (d_a0 == s1))
    del one_row
    nbytes = s0 * s1 * es_d
    pack = cast | ~s_contig
    unpack = ~d_contig
    # Staged: no direct write can do it, or the cost model prefers it. A chunk contiguous
    # on both sides is one direct write, never dearer than staging it.
    staged = cast | (s_a1 != 1) | (d_a1 != 1)
    del cast
    some = np.nonzero(~staged & ~(s_contig & d_contig))[0]
    del s_contig, d_contig
    w_us, p_us = opts.write_overhead_us, opts.pack_overhead_us
    pack_us = p_us + nbytes[some] * 8e-3 / opts.pack_gbps  # bytes * 8 / (Gb/s * 1e3) = us
    staged[some] = w_us + pack[some] * pack_us + unpack[some] * pack_us < s0[some] * w_us
    del some, pack_us
    src_rank, dst_rank = src.rank[choice], dst.rank[d_row]
    world = len(n_regions)
    si = staging_order(np.nonzero(staged)[0], src_rank, dst_rank, nbytes, world)
    su = staged & unpack
    budget = budgets(world, sources, dst_rank[su], nbytes[su], bytes_in, opts, nic_gbps)
    del su
    # Staged chunks start in stage 1 when there are direct writes: those go first, in
    # stage 0, and stage 1's packs run while they are in flight (`schemas.protocol`).
    first = int(bool((~staged).any() and (staged & pack).any()))
    st = place_staging(si, src_rank, dst_rank, pack, unpack, nbytes, budget,
                       opts, chunks.tensor, tensor_names, world, first)
    stage, s_soff, d_soff, staging, slotted = st
    stages = int(stage.max()) + 1 if len(stage) else 1

    # Direct writes: one per row (or the whole box when both sides are contiguous).
    di = np.nonzero(~staged)[0]
    del staged
    whole = (s_a0[di] == s1[di]) & (d_a0[di] == s1[di]) | (s0[di] == 1)
    r = np.where(whole, 1, s0[di])
    idx = np.repeat(di, r)
    k = np.arange(len(idx)) - np.repeat(np.cumsum(r) - r, r)
    d_n = np.repeat(np.where(whole, s0[di] * s1[di], s1[di]) * es_d[di], r)
    del whole, r
    es_s_di = element_size(s_code[idx])
    s_first = _start(src, choice, chunks, idx)
    d_first = _start(dst, d_row, chunks, idx)
    direct = dict(
        w_src_rank=src_rank[idx], w_src_region=src.region[choice[idx]],
        w_src_offset=(s_first + k * s_a0[idx]) * es_s_di,
        w_dst_rank=dst_rank[idx], w_dst_region=dst.region[d_row[idx]],
        w_dst_offset=(d_first + k * d_a0[idx]) * es_d[idx], w_nbytes=d_n)
    del s_first, d_first, k, idx, es_s_di, d_n
    # Staged writes: one per chunk (in placement order `si`, which `stage`, `s_soff` and
    # `d_soff` follow), from staging (if packed) into staging (if unpacked).
    s_start, d_start = _start(src, choice, chunks, si), _start(dst, d_row, chunks, si)
    p_si, u_si = pack[si], unpack[si]
    s_off = np.where(p_si, s_soff, s_start * element_size(s_code[si]))
    d_off = np.where(u_si, d_soff, d_start * es_d[si])
    g = {name: a[si] for name, a in (("src_rank", src_rank), ("dst_rank", dst_rank),
                                     ("s_code", s_code), ("d_code", d_code), ("es_d", es_d),
                                     ("s_a0", s_a0), ("s_a1", s_a1), ("d_a0", d_a0),
                                     ("d_a1", d_a1), ("s0", s0), ("s1", s1))}
    g["s_region"], g["d_region"] = src.region[choice[si]], dst.region[d_row[si]]
    s_reg = np.where(p_si, n_regions[g["src_rank"]], g["s_region"])
    d_reg = np.where(u_si, n_regions[g["dst_rank"]], g["d_region"])
    copies = _copies(p_si, u_si, stage, s_soff, d_soff, n_regions, s_start, d_start, **g)
    cat = np.concatenate
    return Lowered(
        w_src_rank=cat([direct["w_src_rank"], g["src_rank"]]),
        w_src_region=cat([direct["w_src_region"], s_reg]),
        w_src_offset=cat([direct["w_src_offset"], s_off]),
        w_dst_rank=cat([direct["w_dst_rank"], g["dst_rank"]]),
        w_dst_region=cat([direct["w_dst_region"], d_reg]),
        w_dst_offset=cat([direct["w_dst_offset"], d_off]),
        w_nbytes=cat([direct["w_nbytes"], nbytes[si]]),
        w_stage=cat([np.zeros(len(direct["w_nbytes"]), dtype=np.int64), stage]),
        copies=copies, staging=staging, stages=stages, slotted=slotted)


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
    one_p, one_u = np.ones(len(p), np.int64), np.ones(len(u), np.int64)
    cat = np.concatenate
    return {
        "rank": cat([src_rank[p], dst_rank[u]]),
        "kind": cat([np.full(len(p), PACK), np.full(len(u), UNPACK)]),
        "stage": cat([stage[p], stage[u]]),
        "src_region": cat([s_region[p], n_regions[dst_rank[u]]]),
        "src_dtype": cat([s_code[p], d_code[u]]),
        "src_offset": cat([s_start[p], d_soff[u] // es_d[u]]),
        "src_stride0": cat([s_a0[p], s1[u]]),
        "src_stride1": cat([s_a1[p], one_u]),
        "src_stride2": cat([one_p, one_u]),
        "dst_region": cat([n_regions[src_rank[p]], d_region[u]]),
        "dst_dtype": cat([d_code[p], d_code[u]]),
        "dst_offset": cat([s_soff[p] // es_d[p], d_start[u]]),
        "dst_stride0": cat([s1[p], d_a0[u]]),
        "dst_stride1": cat([one_p, d_a1[u]]),
        "dst_stride2": cat([one_p, one_u]),
        "size0": cat([s0[p], s0[u]]),
        "size1": cat([s1[p], s1[u]]),
        "size2": cat([one_p, one_u]),
        "aux_offset": np.zeros(len(p) + len(u), dtype=np.int64),
    }
