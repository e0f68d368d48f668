"""Pass 5b (`gather`): target boxes gathered onto one source, then fanned out.

Two kinds of target box take this path instead of `lower`'s direct one:
- block-FP8 weights (`target.dtype: fp8_block128`): a 128x128 block must be quantized by
  one rank that holds all of it (`fp8.py` checks that target boxes are block-aligned);
- fine-cut boxes: a box that arrives in `c` source chunks at `h` target ranks costs
  `c * h` writes directly, but `c + h` when gathered first; `compiler.py` sends a box here
  when the writes saved outweigh the extra hop of its bytes (FSDP2 row shards of a
  tensor every target rank holds: 256 x 128 writes become 256 + 128).
All target ranks holding the same box (replicas, replicated tensors) receive the output
of one gather. For each target box:
- an *owner* source rank is chosen: the one holding most of the box (ties: the owner
  whose NIC has sent the fewest bytes so far, then the lowest rank: `assign`'s rule, with
  the box's fan-out to targets on other hosts as one unit);
- if the owner holds an FP8 box whole in one piece, QUANT reads it in place; otherwise the
  box is first gathered into the owner's staging: the owner PACKs its own parts, the
  other holders write theirs (source -> source writes);
- QUANT (FP8) writes the e4m3 box and its scales into the owner's staging, or a PACK casts
  the gathered box to the target dtype (plain boxes, when dtypes differ); the owner then
  writes the result (and the scales) to every target rank holding the box.
Rounds: the owner's buffers of one round fit `staging_bytes`; round k gathers in stage
`base + 2k` and converts and sends in stage `base + 2k + 1`, so the gather has landed
(DONE) before it is read, and the next round's gather into the same staging waits for
the owner's ACK.
"""

from __future__ import annotations

import numpy as np

from planner.passes.intersect import PieceTable, element_size, intersect
from planner.passes.lower import ALIGN, Lowered
from planner.spec import ModelSpec
from schemas.config import ConfigError, Options
from schemas.plan import COPY_COLUMNS, DTYPE_CODES, PACK, QUANT
from schemas.protocol import FP8_BLOCK as BLOCK
from schemas.protocol import scale_blocks

FP8_CODE = DTYPE_CODES.index("float8_e4m3fn")


def take(t: PieceTable, rows: np.ndarray) -> PieceTable:
    return PieceTable(*(getattr(t, f)[rows] for f in PieceTable.__slots__))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Staging:
    """Bump allocation of each rank's staging per stage, in two pools: the first
    `budget - budget // 4` bytes (rounded down to `ALIGN`, so that the second pool's offsets
    are aligned too) for the boxes a rank owns, the rest for the parts it packs for other
    owners (so those packs never fall back to row-by-row writes)."""

    def __init__(self, world: int, budget: int) -> None:
        self.used: dict[tuple[int, int, int], int] = {}
        split = (budget - budget // 4) // ALIGN * ALIGN
        self.bounds = ((0, split), (split, budget))
        self.peak = np.zeros(world, dtype=np.int64)

    def _start(self, rank: int, stages: tuple[int, ...], pool: int) -> int:
        return max(self.used.get((rank, s, pool), self.bounds[pool][0]) for s in stages)

    def fits(self, rank: int, stages: tuple[int, ...], nbytes: int, pool: int = 0) -> bool:
        return self._start(rank, stages, pool) + _align(nbytes) <= self.bounds[pool][1]

    def take(self, rank: int, stages: tuple[int, ...], nbytes: int, pool: int = 0) -> int:
        """Offset of `nbytes` live in every stage of `stages` on `rank`."""
        start = self._start(rank, stages, pool)
        for s in stages:
            self.used[(rank, s, pool)] = start + _align(nbytes)
        self.peak[rank] = max(self.peak[rank], start + _align(nbytes))
        return start


class _Out:
    """Rows of writes and copies, turned into columns at the end."""

    W = ("src_rank", "src_region", "src_offset", "dst_rank", "dst_region", "dst_offset",
         "nbytes", "stage")
    C = ("rank", *(n for n, _ in COPY_COLUMNS))

    def __init__(self) -> None:
        self.writes: list[tuple[int, ...]] = []
        self.strided: list[np.ndarray] = []
        self.copies: list[tuple[int, ...]] = []
        self.explain: list[tuple[int, int, int, int, int, int]] = []

    def copy(self, **cols: int) -> None:
        self.copies.append(tuple(int(cols[k]) for k in self.C))

    def runs(self, stage: int, src: tuple[int, int, int], dst: tuple[int, int, int],
             rows: int, row_bytes: int, src_stride: int, dst_stride: int) -> None:
        """`rows` writes of `row_bytes` (byte strides), or one when both sides are dense."""
        if rows == 1 or (src_stride == row_bytes and dst_stride == row_bytes):
            self.writes.append((*src, *dst, rows * row_bytes, stage))
            return
        k = np.arange(rows, dtype=np.int64)
        one = np.ones(rows, dtype=np.int64)
        self.strided.append(np.stack([one * src[0], one * src[1], src[2] + k * src_stride,
                                      one * dst[0], one * dst[1], dst[2] + k * dst_stride,
                                      one * row_bytes, one * stage], axis=1))


def gather(spec: ModelSpec, src: PieceTable, dst: PieceTable, weight_rows: np.ndarray,
           scale_rows: np.ndarray, n_regions: np.ndarray, opts: Options, base: int,
           host: np.ndarray | None = None, nic: np.ndarray | None = None,
           sent: np.ndarray | None = None
           ) -> tuple[Lowered, np.ndarray, np.ndarray, int]:
    """Gathers, conversions (QUANT or cast) and fan-out writes for target rows
    `weight_rows` (FP8 weights and fine-cut boxes); `scale_rows`: the FP8 scale pieces.
    `host`, `nic`: host and NIC of each plan rank (default: one each); `sent`: bytes each
    NIC already sends to other hosts (owners are balanced on top of it). Also returns
    `explain_rows` of the fan-out, per rank the fan-out bytes to other hosts of boxes only
    it could own, and the largest fan-out (bytes) one owner took as a whole."""
    names = [t.name for t in spec.tensors]
    index = {n: i for i, n in enumerate(names)}
    scale_id = {i: index[n + "_scale_inv"] for i, n in enumerate(names)
                if n + "_scale_inv" in index}
    w = take(dst, weight_rows)
    s = take(dst, scale_rows)
    keys = np.stack([w.tensor, w.off0, w.off1, w.size0, w.size1], axis=1)
    tboxes, first, tb_of = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    tb_of = tb_of.reshape(-1)
    chunks = intersect(spec, src, take(w, first))
    # Scale piece of every target weight row: same rank, scale tensor, offsets / 128.
    s_key = {(int(r), int(t), int(a), int(b)): i for i, (r, t, a, b) in
             enumerate(zip(s.rank, s.tensor, s.off0, s.off1))}
    out = _Out()
    alloc = _Staging(len(n_regions), opts.staging_bytes)
    world = len(n_regions)
    host = np.arange(world) if host is None else np.asarray(host)
    nic = np.arange(world) if nic is None else np.asarray(nic)
    load = np.zeros(int(nic.max()) + 1 if world else 0, dtype=np.int64)  # per NIC
    if sent is not None:
        load[:len(sent)] += sent.astype(np.int64)
    owner_only = np.zeros(len(n_regions), dtype=np.int64)
    unit_max = 0  # the largest fan-out one owner takes as a whole (balance granularity)
    rounds: dict[int, int] = {}  # owner -> first round that may still have room
    chunk_ptr = np.searchsorted(chunks.dst, np.arange(len(tboxes) + 1))
    targets_of = np.argsort(tb_of, kind="stable")
    target_ptr = np.searchsorted(tb_of[targets_of], np.arange(len(tboxes) + 1))
    hp = chunks.holder_ptr
    max_stage = base - 1
    # Boxes only one source can own first, then the rest largest first (list scheduling).
    n_chunks = np.diff(chunk_ptr)
    first_chunk = chunk_ptr[:-1].clip(max=max(len(chunks) - 1, 0))
    n_holders = hp[chunks.sbox[first_chunk] + 1] - hp[chunks.sbox[first_chunk]] \
        if len(chunks) else np.zeros(len(tboxes), dtype=np.int64)
    forced = (n_chunks == 1) & (n_holders == 1)
    order = np.lexsort((np.arange(len(tboxes)), -(tboxes[:, 3] * tboxes[:, 4]), ~forced))
    for t in order.tolist():
        tensor, t0, t1, n0, n1 = (int(x) for x in tboxes[t])
        cs = range(chunk_ptr[t], chunk_ptr[t + 1])
        cands = [chunks.holders[hp[chunks.sbox[c]]:hp[chunks.sbox[c] + 1]] for c in cs]
        held: dict[int, int] = {}
        for c, hs in zip(cs, cands):
            for r in set(src.rank[hs].tolist()):
                held[r] = held.get(r, 0) + int(chunks.size0[c] * chunks.size1[c])
        owner = min(held, key=lambda r: (-held[r], load[nic[r]], r))
        rows = []
        for hs in cands:
            mine = hs[src.rank[hs] == owner]
            rows.append(int(mine[0]) if len(mine) else
                        int(min(hs, key=lambda h: (load[nic[src.rank[h]]], src.rank[h]))))
        es = int(element_size(src.dtype[rows[0]]))
        quant = int(w.dtype[first[t]]) == FP8_CODE
        out_code = int(w.dtype[first[t]])
        es_d = int(element_size(np.array([out_code]))[0])
        src_code = int(src.dtype[rows[0]])
        cast = not quant and out_code != src_code
        direct = quant and len(rows) == 1 and int(src.rank[rows[0]]) == owner
        numel, nscale = n0 * n1, scale_blocks(n0, n1)
        g_bytes = 0 if direct else _align(numel * es)
        f_bytes = _align(numel) if quant else _align(numel * es_d) if cast else 0
        need = g_bytes + f_bytes + (_align(nscale * 4) if quant else 0)
        if not alloc.fits(-1, (0,), need):
            raise ConfigError(
                f"options.staging_bytes: {opts.staging_bytes} is too small to gather "
                f"{names[tensor]} rows {t0}..{t0 + n0} cols {t1}..{t1 + n1} ({need} bytes of "
                f"staging, which must fit in 3/4 of the budget); raise "
                f"options.staging_bytes to at least {-(-need * 4 // 3) + ALIGN}")
        k = rounds.get(owner, 0)
        while not alloc.fits(owner, (base + 2 * k, base + 2 * k + 1), need):
            k += 1
        rounds[owner] = k
        gather, quant_stage = base + 2 * k, base + 2 * k + 1
        g_off = alloc.take(owner, (gather, quant_stage), need)
        f_off = g_off + g_bytes
        s_off = f_off + f_bytes
        to = w.rank[targets_of[target_ptr[t]:target_ptr[t + 1]]]
        remote = numel * es_d * int((host[to] != host[owner]).sum())  # NVLink loads no NIC
        load[nic[owner]] += remote
        unit_max = max(unit_max, numel * es_d * len(to))
        if len(held) == 1:
            owner_only[owner] += remote
        max_stage = max(max_stage, quant_stage)
        stg = int(n_regions[owner])
        if direct:
            h = rows[0]
            q_region, q_code = int(src.region[h]), src_code
            q_off = int(src.base[h] + t0 * src.a0[h] + t1 * src.a1[h])
            q_st = (int(src.a0[h]), int(src.a1[h]))
        else:
            q_region, q_code, q_off, q_st = stg, src_code, g_off // es, (n1, 1)
            for c, h in zip(cs, rows):
                c0, c1 = int(chunks.off0[c]), int(chunks.off1[c])
                m0, m1 = int(chunks.size0[c]), int(chunks.size1[c])
                start = int(src.base[h] + c0 * src.a0[h] + c1 * src.a1[h])
                into = g_off // es + (c0 - t0) * n1 + (c1 - t1)
                hr = int(src.rank[h])
                if hr != owner and host[hr] != host[owner]:  # its NIC sends the part
                    load[nic[hr]] += m0 * m1 * es
                pack = dict(kind=PACK, stage=gather, src_region=src.region[h],
                            src_dtype=src_code, src_offset=start, src_stride0=src.a0[h],
                            src_stride1=src.a1[h], src_stride2=1, dst_dtype=src_code,
                            dst_stride0=m1, dst_stride1=1, dst_stride2=1, size0=m0, size1=m1,
                            size2=1, aux_offset=0)
                rows_ok = src.a1[h] == 1 or m1 == 1  # a column is one strided run
                dense = rows_ok and (m0 == 1 or src.a0[h] == m1)
                if hr == owner:  # own part: straight into the gather buffer
                    out.copy(rank=owner, dst_region=stg, dst_offset=into,
                             **{**pack, "dst_stride0": n1})
                elif not dense and m1 == n1 and alloc.fits(hr, (gather,), m0 * m1 * es, 1):
                    # strided on its holder: pack there, then one write
                    off = alloc.take(hr, (gather,), m0 * m1 * es, 1)
                    out.copy(rank=hr, dst_region=int(n_regions[hr]), dst_offset=off // es,
                             **pack)
                    out.runs(gather, (hr, int(n_regions[hr]), off), (owner, stg, into * es),
                             1, m0 * m1 * es, 0, 0)
                elif rows_ok:
                    out.runs(gather, (hr, int(src.region[h]), start * es),
                             (owner, stg, into * es), m0, m1 * es, int(src.a0[h]) * es,
                             n1 * es)
                else:
                    raise ConfigError(f"gather: {names[tensor]} is stored transposed on "
                                      f"source rank {hr}; a gather needs rows")
        if quant or cast:
            out.copy(rank=owner, kind=QUANT if quant else PACK, stage=quant_stage,
                     src_region=q_region, src_dtype=q_code, src_offset=q_off,
                     src_stride0=q_st[0], src_stride1=q_st[1], src_stride2=1, dst_region=stg,
                     dst_dtype=out_code, dst_offset=f_off // es_d, dst_stride0=n1,
                     dst_stride1=1, dst_stride2=1, size0=n0, size1=n1, size2=1,
                     aux_offset=s_off // 4 if quant else 0)
        else:
            f_off = g_off  # the gathered box is already the target's bytes
        rb, cb = -(-n0 // BLOCK), -(-n1 // BLOCK)
        for i in targets_of[target_ptr[t]:target_ptr[t + 1]].tolist():
            d_rank, d_reg = int(w.rank[i]), int(w.region[i])
            if w.a1[i] != 1 and n1 > 1:  # a column lands as one strided run
                raise ConfigError(f"gather: {names[tensor]} is transposed on target rank "
                                  f"{d_rank}; gathered boxes must land as rows")
            d = int(w.base[i] + t0 * w.a0[i] + t1 * w.a1[i])
            out.runs(quant_stage, (owner, stg, f_off), (d_rank, d_reg, d * es_d), n0,
                     n1 * es_d, n1 * es_d, int(w.a0[i]) * es_d)
            out.explain.append((tensor, owner, stg, d_rank, d_reg, numel * es_d))
            if not quant:
                continue
            j = s_key.get((d_rank, scale_id[tensor], t0 // BLOCK, t1 // BLOCK))
            if j is None:
                raise ValueError(f"gather: target rank {d_rank} has no scale piece for "
                                 f"{names[tensor]} block ({t0 // BLOCK}, {t1 // BLOCK})")
            sd = int(s.base[j] + (t0 // BLOCK) * s.a0[j] + (t1 // BLOCK) * s.a1[j])
            out.runs(quant_stage, (owner, stg, s_off), (d_rank, int(s.region[j]), sd * 4), rb,
                     cb * 4, cb * 4, int(s.a0[j]) * 4)
    return _lowered(out, alloc.peak, max_stage + 1), explain_rows(out), owner_only, unit_max


def explain_rows(out: _Out) -> np.ndarray:
    """(tensor, owner, staging region, target rank, target region, bytes) per fan-out."""
    return np.array(out.explain, dtype=np.int64).reshape(-1, 6)


def _lowered(out: _Out, staging: np.ndarray, stages: int) -> Lowered:
    w = np.concatenate([np.array(out.writes, dtype=np.int64).reshape(-1, 8), *out.strided])
    c = np.array(out.copies, dtype=np.int64).reshape(-1, len(_Out.C))
    copies = {name: c[:, i] for i, name in enumerate(_Out.C)}
    return Lowered(*(w[:, i] for i in range(8)), copies=copies, staging=staging,
                   stages=stages)
