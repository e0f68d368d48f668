"""A stage's QUANT ops on a GPU as one kernel: every 128x128 block of every box in one launch.

`quant.quantize_into` is a dozen torch kernels per box, and a stage of an MoE's FP8 plan
holds ~10,000 boxes (one per expert weight): the per-box path launches ~120,000 small
kernels a step. Here a CUDA block quantizes 128x128 blocks of the boxes, a run of them in op order
(one search for its first op), where aligned reading 16 bytes of bf16 and writing 8 of e4m3
at a time, with the formula of `quant.py`,
step by step as the CPU reference does it:
`amax = max(|x|)` in float32, `scale = max(amax, 1e-4) / 448` and `inv = 1 / scale`
correctly rounded (`__fdiv_rn`), `q = x * inv` (`__fmul_rn`), and e4m3 by torch's own
conversion (`fp8e4m3fn_from_fp32_value`, ported below: round to nearest even, saturating).
tests/executor/test_quant_kernel.py and tests/planner/test_fp8_gpu.py hold it to the CPU
reference bit for bit.

Sources of bfloat16 or float32; other dtypes keep the per-box path. Built with NVRTC
through `torch.cuda._compile_kernel`, as the copy kernel is; where that fails, `prepare`
returns None and the per-box path runs.
"""

from __future__ import annotations

import numpy as np
import torch

from schemas.plan import DTYPE_CODES, Table
from schemas.protocol import FP8_BLOCK as BLOCK
from schemas.protocol import scale_stride

from .nvrtc import RuntimeKernel

THREADS = 256
BLOCKS_PER_SM = 8
SRC_KINDS = {"bfloat16": 0, "float32": 1}
"""Source dtypes the kernel reads, and their code in its table."""
COLS = 11
"""Columns of the op table: src address, src strides (elements), m, n, q address, q row
(bytes), scale address, scale row (floats), src kind (0 bfloat16, 1 float32, 2 bfloat16
read 16 bytes at a time), first block (a prefix sum)."""

SOURCE = r"""
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
    const int kind = (int)op[9];  // 0 bf16, 1 float32, 2 bf16 in aligned rows of 8
    float v[64];
    float amax = 0.0f;
    if (kind == 2) {  // thread t: 8 groups of 8 columns, (row, group) = (t/16 + 16k, t%16)
      const long long c = bc * 128 + (t & 15) * 8;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const long long r = br * 128 + (t >> 4) + 16 * k;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (r < m && c < n) w = *(const uint4*)((const unsigned short*)op[0] + r * s0 + c);
        const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          v[8 * k + 2 * j] = __uint_as_float(u[j] << 16);
          v[8 * k + 2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
        }
      }
#pragma unroll
      for (int i = 0; i < 64; ++i) amax = fmaxf(amax, fabsf(v[i]));
    } else {
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
    if (kind == 2) {
      const long long c = bc * 128 + (t & 15) * 8;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const long long r = br * 128 + (t >> 4) + 16 * k;
        unsigned int lo4 = 0u, hi4 = 0u;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          lo4 |= (unsigned int)fp8e4m3fn(__fmul_rn(v[8 * k + j], inv)) << (8 * j);
          hi4 |= (unsigned int)fp8e4m3fn(__fmul_rn(v[8 * k + 4 + j], inv)) << (8 * j);
        }
        if (r < m && c < n) *(uint2*)(q + r * qrow + c) = make_uint2(lo4, hi4);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        const long long r = br * 128 + ((t + i * 256) >> 7), c = bc * 128 + ((t + i * 256) & 127);
        if (r < m && c < n) q[r * qrow + c] = fp8e4m3fn(__fmul_rn(v[i], inv));
      }
    }
    __syncthreads();  // warp_max and inv_s are rewritten by the next block
  }
}
"""


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
    m, n = c["size0"], c["size1"]
    nblocks = -(-m // BLOCK) * -(-n // BLOCK)
    out = np.empty((len(rows), COLS), dtype=np.int64)
    out[:, 0] = base[c["src_region"]] + c["src_offset"] * item
    out[:, 1], out[:, 2], out[:, 3], out[:, 4] = (c["src_stride0"], c["src_stride1"], m, n)
    out[:, 5] = base[c["dst_region"]] + c["dst_offset"]
    out[:, 6] = c["dst_stride0"]
    out[:, 7] = base[c["dst_region"]] + 4 * c["aux_offset"]
    out[:, 8] = scale_stride(c["dst_stride0"])
    out[:, 9] = kind
    out[:, 9] = vector_kind(out)
    out[:, 10] = np.cumsum(nblocks) - nblocks
    return out


def vector_kind(table: np.ndarray) -> np.ndarray:
    """The table's src kinds, bfloat16 boxes of aligned rows of whole 16-byte groups as 2:
    read 16 bytes and written 8 bytes at a time."""
    t = table.astype(np.int64)
    vec = ((t[:, 9] == 0) & (t[:, 2] == 1) & (t[:, 4] % 8 == 0) & (t[:, 0] % 16 == 0)
           & (t[:, 1] % 8 == 0) & (t[:, 5] % 8 == 0) & (t[:, 6] % 8 == 0))
    return np.where(vec, 2, t[:, 9])


class QuantKernel(RuntimeKernel):
    """The compiled kernel of one device; `op` turns a stage's QUANT rows into one launch."""

    SOURCE, NAME, BLOCKS_PER_SM = SOURCE, "rplan_quant", BLOCKS_PER_SM
    FALLBACK = "QUANT ops run box by box"

    def op(self, table: np.ndarray):
        """One op quantizing every box of `table` (capturable in a CUDA graph)."""
        last = table[-1]
        blocks = int(last[10] + -(-last[3] // BLOCK) * -(-last[4] // BLOCK))
        dev = torch.from_numpy(np.ascontiguousarray(table)).to(self.device)
        per_block = -(-blocks // self.max_blocks)  # each CUDA block: a run of 128x128 blocks
        grid = (-(-blocks // per_block), 1, 1)
        nops = len(table)

        def run() -> None:
            self.fn(grid=grid, block=(THREADS, 1, 1),  # type: ignore[operator]
                    args=[dev, nops, blocks, per_block])
        run.table = dev  # type: ignore[attr-defined]  # alive while the op is
        return run


def prepare(copies: Table, rows: np.ndarray, regions: list[torch.Tensor]):
    """(one op for the rows the kernel takes or None, the rows left to the per-box path)."""
    if not len(rows) or not regions or not regions[0].is_cuda:
        return None, rows
    kinds = np.array([DTYPE_CODES[int(d)] in SRC_KINDS
                      for d in np.asarray(copies["src_dtype"])[rows]], dtype=bool)
    if not kinds.any():
        return None, rows
    kernel = QuantKernel.load(regions[0].device)
    if kernel is None:
        return None, rows
    return kernel.op(op_table(copies, rows[kinds], regions)), rows[~kinds]
