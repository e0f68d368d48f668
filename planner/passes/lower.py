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


def _geometry(t: PieceTable, rows: np.ndarray, c: Chunks) -> tuple[np.ndarray, ...]:
    start = t.base[rows] + c.off0 * t.a0[rows] + c.off1 * t.a1[rows]
    return start, t.a0[rows], t.a1[rows]


def lower(chunks: Chunks, choice: np.ndarray, src: PieceTable, dst: PieceTable,
          n_regions: np.ndarray, opts: Options, tensor_names: list[str], sources: int,
          bytes_in: np.ndarray, nic_gbps: float) -> Lowered:
    """Direct writes and staged chunks (packs, writes, unpacks in stages) of `chunks`;
    plan ranks below `sources` are source ranks (`budget.budgets`: their staging budget is
    the cap; a target's is sized from the cost model: `bytes_in` it receives in the whole
    plan, its link at `nic_gbps`)."""
    d_row = chunks.dst
    s_start, s_a0, s_a1 = _geometry(src, choice, chunks)
    d_start, d_a0, d_a1 = _geometry(dst, d_row, chunks)
    s0, s1 = chunks.size0.copy(), chunks.size1.copy()
    col = s1 == 1  # read `n x 1` as `1 x n`
    s_a1 = np.where(col, s_a0, s_a1)
    d_a1 = np.where(col, d_a0, d_a1)
    s0, s1 = np.where(col, 1, s0), np.where(col, s0, s1)
    s_code, d_code = src.dtype[choice], dst.dtype[d_row]
    es_s, es_d = element_size(s_code), element_size(d_code)
    cast = s_code != d_code
    s_contig = (s_a1 == 1) & ((s0 == 1) | (s_a0 == s1))
    d_contig = (d_a1 == 1) & ((s0 == 1) | (d_a0 == s1))
    direct_ok = ~cast & (s_a1 == 1) & (d_a1 == 1)
    runs = np.where(s_contig & d_contig, 1, s0)
    nbytes = s0 * s1 * es_d
    pack = cast | ~s_contig
    unpack = ~d_contig
    w_us, p_us = opts.write_overhead_us, opts.pack_overhead_us
    pack_us = p_us + nbytes * 8e-3 / opts.pack_gbps  # bytes * 8 / (Gb/s * 1e3) = us
    cost_direct = runs * w_us
    cost_staged = w_us + pack * pack_us + unpack * pack_us
    staged = ~direct_ok | (cost_staged < cost_direct)
    src_rank, dst_rank = src.rank[choice], dst.rank[d_row]
    world = len(n_regions)
    si = staging_order(np.nonzero(staged)[0], src_rank, dst_rank, nbytes, world)
    su = staged & unpack
    budget = budgets(world, sources, dst_rank[su], nbytes[su], bytes_in, opts, nic_gbps)
    # Staged chunks start in stage 1 when there are direct writes: those go first, in
    # stage 0, and stage 1's packs run while they are in flight (`schemas.protocol`).
    first = int(bool((~staged).any() and (staged & pack).any()))
    st = place_staging(si, src_rank, dst_rank, pack, unpack, nbytes, budget,
                        opts, chunks.tensor, tensor_names, world, first)
    stage, s_soff, d_soff, staging, slotted = st
    stages = int(stage.max()) + 1 if len(stage) else 1

    # Direct writes: `runs` rows each (or the whole box when both sides are contiguous).
    di = np.nonzero(~staged)[0]
    r = runs[di]
    idx = np.repeat(di, r)
    k = np.arange(len(idx)) - np.repeat(np.cumsum(r) - r, r)
    whole = (runs[idx] == 1)
    d_n = np.where(whole, s0[idx] * s1[idx], s1[idx]) * es_d[idx]
    # Staged writes: one per chunk (in placement order `si`, which `stage`, `s_soff` and
    # `d_soff` follow), from staging (if packed) into staging (if unpacked).
    s_reg = np.where(pack[si], n_regions[src_rank[si]], src.region[choice[si]])
    s_off = np.where(pack[si], s_soff, s_start[si] * es_s[si])
    d_reg = np.where(unpack[si], n_regions[dst_rank[si]], dst.region[d_row[si]])
    d_off = np.where(unpack[si], d_soff, d_start[si] * es_d[si])
    copies = _copies(si, pack, unpack, stage, s_soff, d_soff, src_rank, dst_rank, n_regions,
                     src.region[choice], dst.region[d_row], s_code, d_code, es_d,
                     s_start, s_a0, s_a1, d_start, d_a0, d_a1, s0, s1)
    cat = np.concatenate
    return Lowered(
        w_src_rank=cat([src_rank[idx], src_rank[si]]),
        w_src_region=cat([src.region[choice[idx]], s_reg]),
        w_src_offset=cat([(s_start[idx] + k * s_a0[idx]) * es_s[idx], s_off]),
        w_dst_rank=cat([dst_rank[idx], dst_rank[si]]),
        w_dst_region=cat([dst.region[d_row[idx]], d_reg]),
        w_dst_offset=cat([(d_start[idx] + k * d_a0[idx]) * es_d[idx], d_off]),
        w_nbytes=cat([d_n, nbytes[si]]),
        w_stage=cat([np.zeros(len(idx), dtype=np.int64), stage]),
        copies=copies, staging=staging, stages=stages, slotted=slotted)


def _copies(si, pack, unpack, stage, s_soff, d_soff, src_rank, dst_rank, n_regions,
            s_region, d_region, s_code, d_code, es_d, s_start, s_a0, s_a1,
            d_start, d_a0, d_a1, s0, s1) -> dict[str, np.ndarray]:
    """PACK copies (on sources) then UNPACK copies (on targets) of the staged chunks."""
    p = np.nonzero(pack[si])[0]
    u = np.nonzero(unpack[si])[0]
    pi, ui = si[p], si[u]
    one_p, one_u = np.ones(len(p), np.int64), np.ones(len(u), np.int64)
    cat = np.concatenate
    return {
        "rank": cat([src_rank[pi], dst_rank[ui]]),
        "kind": cat([np.full(len(p), PACK), np.full(len(u), UNPACK)]),
        "stage": cat([stage[p], stage[u]]),
        "src_region": cat([s_region[pi], n_regions[dst_rank[ui]]]),
        "src_dtype": cat([s_code[pi], d_code[ui]]),
        "src_offset": cat([s_start[pi], d_soff[u] // es_d[ui]]),
        "src_stride0": cat([s_a0[pi], s1[ui]]),
        "src_stride1": cat([s_a1[pi], one_u]),
        "src_stride2": cat([one_p, one_u]),
        "dst_region": cat([n_regions[src_rank[pi]], d_region[ui]]),
        "dst_dtype": cat([d_code[pi], d_code[ui]]),
        "dst_offset": cat([s_soff[p] // es_d[pi], d_start[ui]]),
        "dst_stride0": cat([s1[pi], d_a0[ui]]),
        "dst_stride1": cat([one_p, d_a1[ui]]),
        "dst_stride2": cat([one_p, one_u]),
        "size0": cat([s0[pi], s0[ui]]),
        "size1": cat([s1[pi], s1[ui]]),
        "size2": cat([one_p, one_u]),
        "aux_offset": np.zeros(len(p) + len(u), dtype=np.int64),
    }
