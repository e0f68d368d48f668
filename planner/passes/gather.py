"""Pass 5b (`quantize`): block-FP8 target weights, quantized on the sources.

The unit of work is a *target box* of a quantized weight (block-aligned: `fp8.py` checks
the target layout). All target ranks holding the same box (replicas, KV replication)
receive the output of one quantization. For each target box:
- an *owner* source rank is chosen: the one holding most of the box (ties: the owner
  with the fewest bytes to quantize so far, then the lowest rank);
- if the owner holds the whole box in one piece, QUANT reads it in place; otherwise the
  box is first gathered into the owner's staging: the owner PACKs its own parts, the
  other holders write theirs (source -> source writes);
- QUANT writes the e4m3 box and its scales into the owner's staging, and the owner
  writes both to every target rank holding the box (weight and `weight_scale_inv`).
Rounds: the owner's gather, e4m3 and scale buffers of one round fit `staging_bytes`;
round k gathers in stage `base + 2k` and quantizes and sends in stage `base + 2k + 1`,
so the gather has landed (DONE) before QUANT reads it, and the next round's gather into
the same staging waits for the owner's ACK.
"""

from __future__ import annotations

import numpy as np

from planner.fp8 import BLOCK
from planner.passes.intersect import PieceTable, element_size, intersect
from planner.passes.lower import ALIGN, Lowered
from planner.spec import ModelSpec
from schemas.config import ConfigError, Options
from schemas.plan import DTYPE_CODES, PACK, QUANT

FP8_CODE = DTYPE_CODES.index("float8_e4m3fn")


def take(t: PieceTable, rows: np.ndarray) -> PieceTable:
    return PieceTable(*(getattr(t, f)[rows] for f in PieceTable.__slots__))


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Out:
    """Column lists for writes and copies, concatenated at the end."""

    def __init__(self) -> None:
        self.w: dict[str, list] = {k: [] for k in ("src_rank", "src_region", "src_offset",
                                                     "dst_rank", "dst_region", "dst_offset",
                                                     "nbytes", "stage")}
        self.c: dict[str, list] = {}

    def write(self, **cols) -> None:
        for k, v in cols.items():
            self.w[k].append(np.atleast_1d(np.asarray(v, dtype=np.int64)))

    def copy(self, **cols) -> None:
        for k, v in cols.items():
            self.c.setdefault(k, []).append(int(v))

    def runs(self, stage: int, src: tuple[int, int, int], dst: tuple[int, int, int],
             rows: int, row_bytes: int, src_stride: int, dst_stride: int) -> None:
        """`rows` writes of `row_bytes` (byte strides), or one when both sides are dense."""
        if rows == 1 or (src_stride == row_bytes and dst_stride == row_bytes):
            rows, row_bytes = 1, rows * row_bytes
        k = np.arange(rows, dtype=np.int64)
        self.write(src_rank=np.full(rows, src[0]), src_region=np.full(rows, src[1]),
                   src_offset=src[2] + k * src_stride, dst_rank=np.full(rows, dst[0]),
                   dst_region=np.full(rows, dst[1]), dst_offset=dst[2] + k * dst_stride,
                   nbytes=np.full(rows, row_bytes), stage=np.full(rows, stage))


def quantize(spec: ModelSpec, src: PieceTable, dst: PieceTable, weight_rows: np.ndarray,
             scale_rows: np.ndarray, n_regions: np.ndarray, opts: Options, base: int
             ) -> Lowered:
    """Gathers, QUANT copies and writes for the quantized weights' target rows."""
    names = [t.name for t in spec.tensors]
    scale_id = {i: names.index(n + "_scale_inv") for i, n in enumerate(names)
                if n + "_scale_inv" in names} if len(weight_rows) else {}
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
    staging = np.zeros(len(n_regions), dtype=np.int64)
    load = np.zeros(len(n_regions), dtype=np.int64)
    rounds: dict[int, list[int]] = {}  # owner -> [round, bytes used in it]
    chunk_ptr = np.searchsorted(chunks.dst, np.arange(len(tboxes) + 1))
    targets_of = np.argsort(tb_of, kind="stable")
    target_ptr = np.searchsorted(tb_of[targets_of], np.arange(len(tboxes) + 1))
    hp = chunks.holder_ptr
    max_stage = base - 1
    for t in range(len(tboxes)):
        tensor, t0, t1, n0, n1 = (int(x) for x in tboxes[t])
        cs = range(chunk_ptr[t], chunk_ptr[t + 1])
        cands = [chunks.holders[hp[chunks.sbox[c]]:hp[chunks.sbox[c] + 1]] for c in cs]
        held: dict[int, int] = {}
        for c, hs in zip(cs, cands):
            for r in set(src.rank[hs].tolist()):
                held[r] = held.get(r, 0) + int(chunks.size0[c] * chunks.size1[c])
        owner = min(held, key=lambda r: (-held[r], load[r], r))
        rows = []
        for hs in cands:
            mine = hs[src.rank[hs] == owner]
            rows.append(int(mine[0]) if len(mine) else
                        int(min(hs, key=lambda h: (load[src.rank[h]], src.rank[h]))))
        es = int(element_size(src.dtype[rows[0]]))
        direct = len(rows) == 1 and int(src.rank[rows[0]]) == owner
        numel, nscale = n0 * n1, -(-n0 // BLOCK) * -(-n1 // BLOCK)
        g_bytes = 0 if direct else _align(numel * es)
        need = g_bytes + _align(numel) + _align(nscale * 4)
        if need > opts.staging_bytes:
            raise ConfigError(
                f"options.staging_bytes: {opts.staging_bytes} is too small to quantize "
                f"{names[tensor]} rows {t0}..{t0 + n0} cols {t1}..{t1 + n1} ({need} bytes of "
                f"staging); raise options.staging_bytes to at least {need}")
        rnd = rounds.setdefault(owner, [0, 0])
        if rnd[1] + need > opts.staging_bytes:
            rnd[0], rnd[1] = rnd[0] + 1, 0
        g_off, f_off = rnd[1], rnd[1] + g_bytes
        s_off = f_off + _align(numel)
        rnd[1] += need
        staging[owner] = max(staging[owner], rnd[1])
        load[owner] += numel
        gather, quant = base + 2 * rnd[0], base + 2 * rnd[0] + 1
        max_stage = max(max_stage, quant)
        stg = int(n_regions[owner])
        src_code = int(src.dtype[rows[0]])
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
                if int(src.rank[h]) == owner or src.a1[h] != 1:
                    if int(src.rank[h]) != owner:
                        raise ConfigError(f"quantize: {names[tensor]} is stored transposed on "
                                          f"source rank {src.rank[h]}; FP8 gather needs rows")
                    out.copy(rank=owner, kind=PACK, stage=gather, src_region=src.region[h],
                             src_dtype=src_code, src_offset=start, src_stride0=src.a0[h],
                             src_stride1=src.a1[h], src_stride2=1, dst_region=stg,
                             dst_dtype=src_code, dst_offset=into, dst_stride0=n1,
                             dst_stride1=1, dst_stride2=1, size0=m0, size1=m1, size2=1,
                             aux_offset=0)
                else:
                    out.runs(gather, (int(src.rank[h]), int(src.region[h]), start * es),
                             (owner, stg, into * es), m0, m1 * es, int(src.a0[h]) * es,
                             n1 * es)
        out.copy(rank=owner, kind=QUANT, stage=quant, src_region=q_region, src_dtype=q_code,
                 src_offset=q_off, src_stride0=q_st[0], src_stride1=q_st[1], src_stride2=1,
                 dst_region=stg, dst_dtype=FP8_CODE, dst_offset=f_off, dst_stride0=n1,
                 dst_stride1=1, dst_stride2=1, size0=n0, size1=n1, size2=1,
                 aux_offset=s_off // 4)
        rb, cb = -(-n0 // BLOCK), -(-n1 // BLOCK)
        for i in targets_of[target_ptr[t]:target_ptr[t + 1]].tolist():
            d_rank, d_reg = int(w.rank[i]), int(w.region[i])
            if w.a1[i] != 1:
                raise ConfigError(f"quantize: {names[tensor]} is transposed on target rank "
                                  f"{d_rank}; FP8 targets must store weights [out, in]")
            d = int(w.base[i] + t0 * w.a0[i] + t1 * w.a1[i])
            out.runs(quant, (owner, stg, f_off), (d_rank, d_reg, d), n0, n1, n1,
                     int(w.a0[i]))
            j = s_key.get((d_rank, scale_id[tensor], t0 // BLOCK, t1 // BLOCK))
            if j is None:
                raise ValueError(f"quantize: target rank {d_rank} has no scale piece for "
                                 f"{names[tensor]} block ({t0 // BLOCK}, {t1 // BLOCK})")
            sd = int(s.base[j] + (t0 // BLOCK) * s.a0[j] + (t1 // BLOCK) * s.a1[j])
            out.runs(quant, (owner, stg, s_off), (d_rank, int(s.region[j]), sd * 4), rb,
                     cb * 4, cb * 4, int(s.a0[j]) * 4)
    return _lowered(out, staging, max_stage + 1)


def _lowered(out: _Out, staging: np.ndarray, stages: int) -> Lowered:
    def col(parts: list) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    from schemas.plan import COPY_COLUMNS

    copies = {name: np.asarray(out.c.get(name, []), dtype=np.int64)
              for name in ("rank", *(n for n, _ in COPY_COLUMNS))}
    return Lowered(w_src_rank=col(out.w["src_rank"]), w_src_region=col(out.w["src_region"]),
                   w_src_offset=col(out.w["src_offset"]), w_dst_rank=col(out.w["dst_rank"]),
                   w_dst_region=col(out.w["dst_region"]),
                   w_dst_offset=col(out.w["dst_offset"]), w_nbytes=col(out.w["nbytes"]),
                   w_stage=col(out.w["stage"]), copies=copies, staging=staging, stages=stages)
