"""A stage's QUANT ops on a GPU: every 128x128 block of every box in one launch.

`quant.quantize_into` is a dozen torch kernels per box, and a stage of an MoE's FP8 plan
holds ~10,000 boxes (one per expert weight): the per-box path launches ~120,000 small
kernels a step. Here a CUDA block quantizes a run of 128x128 blocks of the boxes in op
order (one search for its first op), with the formula of `quant.py`, step by step as the
CPU reference does it: `amax = max(|x|)` in float32, `scale = max(amax, 1e-4) / 448` and
`inv = 1 / scale` correctly rounded (`__fdiv_rn`), `q = x * inv` (`__fmul_rn`), and e4m3
as torch converts (`fp8e4m3fn_from_fp32_value`, ported below as `fp8e4m3fn`: round to
nearest even; from 464 up, where torch gives NaN, the port saturates to 448, a value the
quantizer never converts: `x * inv` is at most 448 and a few ulps).

Two kernels. `rplan_quant_rows` takes bfloat16 boxes of aligned rows of whole 16-byte
groups (the common case: a weight's rows, aligned): each thread copies its 8 pieces of 16
bytes of a block into its own slots of shared memory with `cp.async`, `STAGES` - 1 blocks
ahead, so the reads of the next blocks are in flight while it quantizes this one from
its own copy (one barrier a block, for the amax); e4m3 comes from the hardware's
conversion (`cvt.rn.satfinite.e4m3x2.f32`, the port's bits for every float32 that is not
NaN; a group of four with a NaN out is converted again by the port, which keeps the NaN's
sign), written 8 bytes at a time. One wave of CUDA blocks, each an even share of the
blocks. Through the port for every value the kernel is bound by its arithmetic, not its
memory (the `sw` build of scripts/quant_kernel_bench.py). `rplan_quant` takes the rest
(float32 sources, strided or unaligned rows) element by element.
tests/executor/test_quant_kernel.py and tests/planner/test_fp8_gpu.py hold both to the CPU
reference bit for bit, and the rows kernel's conversion to the port for every float32.

Sources of bfloat16 or float32; other dtypes keep the per-box path. Built with NVRTC
through `torch.cuda._compile_kernel`, as the copy kernel is; where the rows kernel cannot
be built its boxes go to `rplan_quant`, and where that fails too, to the per-box path.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from schemas.plan import DTYPE_CODES, Table
from schemas.protocol import FP8_BLOCK as BLOCK
from schemas.protocol import scale_stride

from .nvrtc import RuntimeKernel

THREADS = 256
BLOCKS_PER_SM = 8
STAGES = 2
"""Blocks of 128x128 a CUDA block of the rows kernel holds in shared memory (32 KiB each):
the one it quantizes and those it reads ahead (scripts/quant_kernel_bench.py times others)."""
ROWS_CTAS_PER_SM = 3
"""CUDA blocks of the rows kernel per SM (one wave: each takes an even share of blocks)."""
SRC_KINDS = {"bfloat16": 0, "float32": 1}
"""Source dtypes the kernel reads, and their code in its table."""
ROWS = 2
"""The table's src kind of a bfloat16 box of aligned rows of whole 16-byte groups."""
COLS = 11
"""Columns of the op table: src address, src strides (elements), m, n, q address, q row
(bytes), scale address, scale row (floats), src kind (0 bfloat16, 1 float32, 2 bfloat16
read 16 bytes at a time), first block (a prefix sum)."""

E4M3 = r"""
#ifndef RPLAN_HW_E4M3
#define RPLAN_HW_E4M3 1
#endif
__device__ __forceinline__ unsigned char fp8e4m3fn(float f) {
  unsigned int bits = __float_as_uint(f);
  const unsigned int sign = bits & 0x80000000u;
  bits ^= sign;
  unsigned char r;
  if (bits >= (1087u << 20)) {
    r = bits > 0x7F800000u ? 0x7f : 0x7e;
  } else if (bits < (121u << 23)) {
    const unsigned int denorm = 141u << 23;
    bits = __float_as_uint(__fadd_rn(__uint_as_float(bits), __uint_as_float(denorm)));
    r = (unsigned char)(bits - denorm);
  } else {
    const unsigned int odd = (bits >> 20) & 1u;
    bits += ((unsigned int)(7 - 127) << 23) + 0x7FFFFu;
    bits += odd;
    r = (unsigned char)(bits >> 20);
    if (r == 0x7f) r = 0x7e;
  }
  return r | (unsigned char)(sign >> 24);
}

// Four floats to e4m3, the first in the low byte. The hardware rounds to nearest even and
// saturates as torch does; a NaN (S.1111.111 out) is converted again by the port, which
// keeps its sign.
__device__ __forceinline__ unsigned int e4m3x4(float a, float b, float c, float d) {
#if RPLAN_HW_E4M3
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  const unsigned int w = (unsigned int)lo | ((unsigned int)hi << 16);
  if (((((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) == 0u)) return w;
#endif
  return (unsigned int)fp8e4m3fn(a) | ((unsigned int)fp8e4m3fn(b) << 8)
         | ((unsigned int)fp8e4m3fn(c) << 16) | ((unsigned int)fp8e4m3fn(d) << 24);
}
"""

SOURCE = E4M3 + r"""
extern "C" __global__ void __launch_bounds__(256) rplan_quant(
    const long long* __restrict__ ops, int nops, int blocks, int per_block) {
  __shared__ float warp_max[8];
  __shared__ float inv_s;
  const int t = threadIdx.x;
  const long long b0 = (long long)blockIdx.x * per_block;
  if (b0 >= blocks) return;
  int lo = 0, hi = nops - 1;  // the last op whose first block is <= b0
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (ops[mid * 11 + 10] <= b0) lo = mid; else hi = mid - 1;
  }
  const long long b1 = min(b0 + per_block, (long long)blocks);
  for (long long b = b0; b < b1; ++b) {
    while (lo + 1 < nops && ops[(lo + 1) * 11 + 10] <= b) ++lo;  // blocks run in op order
    const long long* op = ops + lo * 11;
    const long long s0 = op[1], s1 = op[2], m = op[3], n = op[4], qrow = op[6];
    const long long nbc = (n + 127) / 128, blk = b - op[10];
    const long long br = blk / nbc, bc = blk % nbc;
    const int kind = (int)op[9];  // 0 bf16, 1 float32
    float v[64];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const long long r = br * 128 + ((t + i * 256) >> 7), c = bc * 128 + ((t + i * 256) & 127);
      float x = 0.0f;
      if (r < m && c < n) {
        const long long e = r * s0 + c * s1;
        x = kind == 1 ? ((const float*)op[0])[e]
                      : __uint_as_float(((unsigned int)((const unsigned short*)op[0])[e]) << 16);
      }
      v[i] = x;
      amax = fmaxf(amax, fabsf(x));
    }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((t & 31) == 0) warp_max[t >> 5] = amax;
    __syncthreads();
    if (t == 0) {
      float a = warp_max[0];
      for (int w = 1; w < 8; ++w) a = fmaxf(a, warp_max[w]);
      const float scale = __fdiv_rn(fmaxf(a, 1e-4f), 448.0f);
      ((float*)op[7])[br * op[8] + bc] = scale;
      inv_s = __fdiv_rn(1.0f, scale);
    }
    __syncthreads();
    const float inv = inv_s;
    unsigned char* q = (unsigned char*)op[5];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const long long r = br * 128 + ((t + i * 256) >> 7), c = bc * 128 + ((t + i * 256) & 127);
      if (r < m && c < n) q[r * qrow + c] = fp8e4m3fn(__fmul_rn(v[i], inv));
    }
    __syncthreads();  // warp_max and inv_s are rewritten by the next block
  }
}
"""

ROWS_SOURCE = E4M3 + r"""
// RPLAN_STAGES (blocks held in shared memory) and RPLAN_CTAS (CUDA blocks per SM): rows_source

// The op of block b, from the op `lo` of an earlier block (blocks run in op order).
__device__ __forceinline__ const long long* op_of(const long long* __restrict__ ops, int nops,
                                                  int& lo, long long b) {
  while (lo + 1 < nops && ops[(lo + 1) * 11 + 10] <= b) ++lo;
  return ops + lo * 11;
}

// Thread t's part of block b: rows t/16 + 16k (k < 8), columns 8 (t%16) .. +7, 16 bytes
// each, into its own 8 slots at `dst` (a slot 4096 bytes past the last); zeros past the box.
__device__ __forceinline__ void load_block(const long long* __restrict__ ops, int nops,
                                           int& lo, long long b, unsigned dst, int t) {
  const long long* op = op_of(ops, nops, lo, b);
  const long long s0 = op[1], m = op[3], n = op[4];
  const long long nbc = (n + 127) >> 7, blk = b - op[10];
  const long long br = blk / nbc, bc = blk - br * nbc;
  const long long r0 = br * 128 + (t >> 4), c = bc * 128 + (t & 15) * 8;
  const unsigned short* src = (const unsigned short*)op[0];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const long long r = r0 + 16 * k;
    const bool in = r < m && c < n;
    const void* p = in ? (const void*)(src + r * s0 + c) : (const void*)src;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst + 4096u * k), "l"(p), "r"(in ? 16 : 0) : "memory");
  }
}

extern "C" __global__ void __launch_bounds__(256, RPLAN_CTAS) rplan_quant_rows(
    const long long* __restrict__ ops, int nops, int blocks) {
  extern __shared__ uint4 held[];  // RPLAN_STAGES blocks, each 2048 slots of 16 bytes
  __shared__ float warp_max[2][8];
  const int t = threadIdx.x;
  const long long b0 = (long long)blocks * blockIdx.x / gridDim.x;
  const int mine = (int)((long long)blocks * (blockIdx.x + 1) / gridDim.x - b0);
  int lo = 0, hi = nops - 1;  // the last op whose first block is <= b0
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (ops[mid * 11 + 10] <= b0) lo = mid; else hi = mid - 1;
  }
  int lo_in = lo;
  const unsigned base = (unsigned)__cvta_generic_to_shared(held) + 16u * t;
#pragma unroll 1
  for (int k = 0; k < RPLAN_STAGES - 1; ++k) {
    if (k < mine) load_block(ops, nops, lo_in, b0 + k, base + 32768u * k, t);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
#pragma unroll 1
  for (int k = 0; k < mine; ++k) {
    const int ahead = k + RPLAN_STAGES - 1;  // into the slots read one block ago
    if (ahead < mine)
      load_block(ops, nops, lo_in, b0 + ahead, base + 32768u * (ahead % RPLAN_STAGES), t);
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group %0;" :: "n"(RPLAN_STAGES - 1) : "memory");
    const uint4* mine16 = held + 2048 * (k % RPLAN_STAGES) + t;  // this thread's own copies
    unsigned int u[32];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint4 w = mine16[256 * j];
      u[4 * j] = w.x; u[4 * j + 1] = w.y; u[4 * j + 2] = w.z; u[4 * j + 3] = w.w;
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i)
      amax = fmaxf(fmaxf(amax, fabsf(__uint_as_float(u[i] << 16))),
                   fabsf(__uint_as_float(u[i] & 0xffff0000u)));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((t & 31) == 0) warp_max[k & 1][t >> 5] = amax;  // two sets: one barrier a block
    __syncthreads();
    float a = warp_max[k & 1][0];
#pragma unroll
    for (int w = 1; w < 8; ++w) a = fmaxf(a, warp_max[k & 1][w]);
    const float scale = __fdiv_rn(fmaxf(a, 1e-4f), 448.0f);
    const float inv = __fdiv_rn(1.0f, scale);
    const long long* op = op_of(ops, nops, lo, b0 + k);
    const long long m = op[3], n = op[4], qrow = op[6];
    const long long nbc = (n + 127) >> 7, blk = b0 + k - op[10];
    const long long br = blk / nbc, bc = blk - br * nbc;
    if (t == 0) ((float*)op[7])[br * op[8] + bc] = scale;
    const long long r0 = br * 128 + (t >> 4), c = bc * 128 + (t & 15) * 8;
    unsigned char* q = (unsigned char*)op[5] + c;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const long long r = r0 + 16 * j;
#define RPLAN_Q(i) __fmul_rn(__uint_as_float(i), inv)
      const unsigned int w0 = e4m3x4(RPLAN_Q(u[4 * j] << 16), RPLAN_Q(u[4 * j] & 0xffff0000u),
                                     RPLAN_Q(u[4 * j + 1] << 16),
                                     RPLAN_Q(u[4 * j + 1] & 0xffff0000u));
      const unsigned int w1 = e4m3x4(RPLAN_Q(u[4 * j + 2] << 16),
                                     RPLAN_Q(u[4 * j + 2] & 0xffff0000u),
                                     RPLAN_Q(u[4 * j + 3] << 16),
                                     RPLAN_Q(u[4 * j + 3] & 0xffff0000u));
#undef RPLAN_Q
      if (r < m && c < n) *(uint2*)(q + r * qrow) = make_uint2(w0, w1);
    }
  }
}
"""


def rows_source(stages: int = STAGES, ctas_per_sm: int = ROWS_CTAS_PER_SM,
                hw_e4m3: bool = True) -> str:
    """The rows kernel's source for `stages` blocks held and `ctas_per_sm` CUDA blocks per
    SM; `hw_e4m3` False: every value through the port (the conversion's slower twin)."""
    return (f"#define RPLAN_STAGES {int(stages)}\n#define RPLAN_CTAS {int(ctas_per_sm)}\n"
            f"#define RPLAN_HW_E4M3 {int(hw_e4m3)}\n" + ROWS_SOURCE)


def op_table(copies: Table, rows: np.ndarray, regions: list[torch.Tensor]) -> np.ndarray:
    """`(len(rows), COLS)` int64: each QUANT row's addresses, strides and sizes, and the
    number of 128x128 blocks before it (the kernel's grid walks them all)."""
    c = {k: np.asarray(copies[k])[rows].astype(np.int64) for k in (
        "src_region", "src_offset", "src_stride0", "src_stride1", "size0", "size1",
        "dst_region", "dst_offset", "dst_stride0", "aux_offset", "src_dtype")}
    base = np.array([r.data_ptr() for r in regions], dtype=np.int64)
    kind = np.array([SRC_KINDS.get(DTYPE_CODES[int(d)], -1) for d in c["src_dtype"]],
                    dtype=np.int64)
    item = np.where(kind == 1, 4, 2)
    out = np.empty((len(rows), COLS), dtype=np.int64)
    out[:, 0] = base[c["src_region"]] + c["src_offset"] * item
    out[:, 1], out[:, 2] = c["src_stride0"], c["src_stride1"]
    out[:, 3], out[:, 4] = c["size0"], c["size1"]
    out[:, 5] = base[c["dst_region"]] + c["dst_offset"]
    out[:, 6] = c["dst_stride0"]
    out[:, 7] = base[c["dst_region"]] + 4 * c["aux_offset"]
    out[:, 8] = scale_stride(c["dst_stride0"])
    out[:, 9] = kind
    out[:, 9] = vector_kind(out)
    return firsts(out)


def firsts(table: np.ndarray) -> np.ndarray:
    """`table` with its last column the number of 128x128 blocks of the rows before each."""
    out = np.array(table, dtype=np.int64)
    nblocks = -(-out[:, 3] // BLOCK) * -(-out[:, 4] // BLOCK)
    out[:, 10] = np.cumsum(nblocks) - nblocks
    return out


def vector_kind(table: np.ndarray) -> np.ndarray:
    """The table's src kinds, bfloat16 boxes of aligned rows of whole 16-byte groups as
    `ROWS`: read 16 bytes and written 8 bytes at a time."""
    t = table.astype(np.int64)
    vec = ((t[:, 9] == 0) & (t[:, 2] == 1) & (t[:, 4] % 8 == 0) & (t[:, 0] % 16 == 0)
           & (t[:, 1] % 8 == 0) & (t[:, 5] % 8 == 0) & (t[:, 6] % 8 == 0))
    return np.where(vec, ROWS, t[:, 9])


def _blocks(table: np.ndarray) -> int:
    last = table[-1]
    return int(last[10] + -(-last[3] // BLOCK) * -(-last[4] // BLOCK))


class QuantKernel(RuntimeKernel):
    """The element-by-element kernel of one device; `op` turns QUANT rows into one launch."""

    SOURCE, NAME, BLOCKS_PER_SM = SOURCE, "rplan_quant", BLOCKS_PER_SM
    FALLBACK = "QUANT ops run box by box"

    def op(self, table: np.ndarray) -> Callable[[], None]:
        """One op quantizing every box of `table` (capturable in a CUDA graph)."""
        table = firsts(table)
        blocks = _blocks(table)
        dev = torch.from_numpy(np.ascontiguousarray(table)).to(self.device)
        per_block = -(-blocks // self.max_blocks)  # each CUDA block: a run of 128x128 blocks
        grid = (-(-blocks // per_block), 1, 1)
        nops = len(table)

        def run() -> None:
            self.fn(grid=grid, block=(THREADS, 1, 1),  # type: ignore[operator]
                    args=[dev, nops, blocks, per_block])
        run.table = dev  # type: ignore[attr-defined]  # alive while the op is
        return run


class RowsQuantKernel(RuntimeKernel):
    """The kernel of `ROWS` boxes of one device, read ahead through shared memory."""

    SOURCE, NAME, BLOCKS_PER_SM = rows_source(), "rplan_quant_rows", ROWS_CTAS_PER_SM
    FALLBACK = "bfloat16 rows are quantized element by element"
    SHARED = STAGES * THREADS * 8 * 16
    """Dynamic shared memory of a CUDA block: `STAGES` blocks of 128x128 bfloat16."""

    def __init__(self, fn: object, device: torch.device) -> None:
        super().__init__(fn, device)
        fn.set_shared_memory_config(self.SHARED)  # type: ignore[attr-defined]

    def op(self, table: np.ndarray) -> Callable[[], None]:
        """One op quantizing every box of `table` (all `ROWS`; capturable in a CUDA graph)."""
        table = firsts(table)
        blocks = _blocks(table)
        dev = torch.from_numpy(np.ascontiguousarray(table)).to(self.device)
        grid = (min(blocks, self.max_blocks), 1, 1)  # one wave, an even share each
        nops, shared = len(table), self.SHARED

        def run() -> None:
            self.fn(grid=grid, block=(THREADS, 1, 1),  # type: ignore[operator]
                    args=[dev, nops, blocks], shared_mem=shared)
        run.table = dev  # type: ignore[attr-defined]  # alive while the op is
        return run


def quant_op(table: np.ndarray, device: torch.device) -> Callable[[], None] | None:
    """One op quantizing every box of `table` on `device` (the rows kernel for its `ROWS`
    boxes, the element-by-element kernel for the rest), or None where neither kernel can
    be built."""
    rows = table[:, 9] == ROWS
    fast = RowsQuantKernel.load(device) if rows.any() else None
    if fast is None:
        rest = np.array(table, dtype=np.int64)
        rest[:, 9] = np.where(rows, SRC_KINDS["bfloat16"], rest[:, 9])
        rows = np.zeros(len(table), dtype=bool)
    else:
        rest = table
    ops = [fast.op(table[rows])] if fast is not None else []
    if not rows.all():
        slow = QuantKernel.load(device)
        if slow is None:
            return None
        ops.append(slow.op(rest[~rows]))
    if len(ops) == 1:
        return ops[0]

    def run() -> None:
        for op in ops:
            op()
    run.ops = ops  # type: ignore[attr-defined]
    return run


def prepare(copies: Table, rows: np.ndarray, regions: list[torch.Tensor]):
    """(one op for the rows the kernels take or None, the rows left to the per-box path)."""
    if not len(rows) or not regions or not regions[0].is_cuda:
        return None, rows
    kinds = np.array([DTYPE_CODES[int(d)] in SRC_KINDS
                      for d in np.asarray(copies["src_dtype"])[rows]], dtype=bool)
    if not kinds.any():
        return None, rows
    op = quant_op(op_table(copies, rows[kinds], regions), regions[0].device)
    if op is None:
        return None, rows
    return op, rows[~kinds]
