"""One kernel for a batch of byte copies: every write of a batch in one launch, on the SMs.

A copy engine pays a fixed cost per copy (less with four engines side by side), so a batch
of many 1 MiB writes runs well below the speed of one copy of the same bytes however it is
posted (BENCHMARKS.md). This kernel reads a table of (dst, src, nbytes) pieces of at most
`CHUNK` bytes (every write cut into such pieces, at 16-byte multiples of its start) and
each block copies pieces in turn, 16 bytes per load where both sides are 16-byte aligned
alike (the plan's offsets nearly always are), bytes otherwise. It writes to this device's
memory (a process's own or another's opened through CUDA IPC) and to another GPU's memory
mapped in this device's context (`cuda_ipc` opens a peer's handles there itself: memory
that torch opened in the owner device's context faulted, CUDA error 700 on two NVLinked
H100s).

It is built at run time with NVRTC through `torch.cuda._compile_kernel` (no compiler
needed at install) once per process and device, and captured in the batch's CUDA graph, so
a post is one graph launch. Where that torch function, NVRTC or the compile fails, `load`
returns None and the transport uses the copy engines. The SMs it borrows are idle during a
weight update on an inference engine; `copy_kernel: false` keeps them free.
"""

from __future__ import annotations

import numpy as np
import torch

from .nvrtc import RuntimeKernel

CHUNK = 1 << 18
"""Bytes per piece: a block's unit of work (many pieces per block keep the SMs even)."""
THREADS = 512
BLOCKS_PER_SM = 4

SOURCE = r"""
#if RPLAN_STREAMING
#define LOAD4(p) __ldcs(p)
#define STORE4(p, v) __stcs(p, v)
#else
#define LOAD4(p) (*(p))
#define STORE4(p, v) (*(p) = (v))
#endif
#ifndef RPLAN_UNROLL
#define RPLAN_UNROLL 4
#endif
extern "C" __global__ void __launch_bounds__(512) rplan_copy(
    const long long* __restrict__ table, int pieces) {
  const long long t = threadIdx.x, bd = blockDim.x;
  for (int c = blockIdx.x; c < pieces; c += gridDim.x) {
    unsigned char* dst = (unsigned char*)table[3 * (long long)c];
    const unsigned char* src = (const unsigned char*)table[3 * (long long)c + 1];
    const long long n = table[3 * (long long)c + 2];
    long long head = 0, body = 0;
    if ((((unsigned long long)dst ^ (unsigned long long)src) & 15ULL) == 0ULL) {
      head = (long long)((16ULL - ((unsigned long long)dst & 15ULL)) & 15ULL);
      if (head > n) head = n;
      body = (n - head) >> 4;
    }
    for (long long i = t; i < head; i += bd) dst[i] = src[i];
    uint4* d4 = (uint4*)(dst + head);
    const uint4* s4 = (const uint4*)(src + head);
    long long i = t;
    for (; i + (RPLAN_UNROLL - 1) * bd < body; i += RPLAN_UNROLL * bd) {
      uint4 v[RPLAN_UNROLL];
#pragma unroll
      for (int u = 0; u < RPLAN_UNROLL; ++u) v[u] = LOAD4(s4 + i + u * bd);
#pragma unroll
      for (int u = 0; u < RPLAN_UNROLL; ++u) STORE4(d4 + i + u * bd, v[u]);
    }
    for (; i < body; i += bd) STORE4(d4 + i, LOAD4(s4 + i));
    for (long long j = head + (body << 4) + t; j < n; j += bd) dst[j] = src[j];
  }
}
"""


def coalesce(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, dst_alloc: np.ndarray,
             src_alloc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive writes that are adjacent in memory on both sides and stay inside one
    allocation on each side (int64 arrays; `*_alloc`: each write's allocation base). A copy
    engine's copy that spans two allocations, even adjacent ones, fails
    (cudaErrorInvalidValue)."""
    if len(nbytes) < 2:
        return dst, src, nbytes
    cut = (src[1:] != src[:-1] + nbytes[:-1]) | (dst[1:] != dst[:-1] + nbytes[:-1]) | \
        (src_alloc[1:] != src_alloc[:-1]) | (dst_alloc[1:] != dst_alloc[:-1])
    first = np.flatnonzero(np.concatenate([[True], cut]))
    return dst[first], src[first], np.add.reduceat(nbytes, first)


def piece_table(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray,
                chunk: int = CHUNK) -> np.ndarray:
    """`(pieces, 3)` int64 rows (dst, src, nbytes): each write cut into pieces of `chunk`
    bytes (a multiple of 16, so a piece keeps its write's alignment) and a last shorter one;
    writes of 0 bytes have none."""
    assert chunk > 0 and chunk % 16 == 0, chunk
    n = np.asarray(nbytes, dtype=np.int64)
    count = -(-n // chunk)
    write = np.repeat(np.arange(len(n)), count)
    start = np.repeat(np.cumsum(count) - count, count)
    off = (np.arange(len(write), dtype=np.int64) - start) * chunk
    out = np.empty((len(write), 3), dtype=np.int64)
    out[:, 0] = np.asarray(dst, dtype=np.int64)[write] + off
    out[:, 1] = np.asarray(src, dtype=np.int64)[write] + off
    out[:, 2] = np.minimum(n[write] - off, chunk)
    return out


class CopyKernel(RuntimeKernel):
    """The compiled kernel of one device; `launch` queues a table's copies on a stream."""

    SOURCE, NAME, BLOCKS_PER_SM = SOURCE, "rplan_copy", BLOCKS_PER_SM
    FALLBACK = "copies go through the copy engines"

    def table(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> torch.Tensor:
        """The device table of a batch's writes (keep it alive while the kernel may run)."""
        rows = piece_table(dst, src, nbytes)
        return torch.from_numpy(rows).to(self.device)

    def launch(self, table: torch.Tensor, share: float = 1.0) -> None:
        """Queue the copies of `table` on the current stream (capturable in a graph), on a
        grid of `share` of the blocks that fill the device (at least one a piece's worth)."""
        pieces = table.shape[0]
        blocks = max(1, int(self.max_blocks * min(max(share, 0.0), 1.0)))
        if pieces:
            self.fn(grid=(min(pieces, blocks), 1, 1), block=(THREADS, 1, 1),  # type: ignore[operator]
                    args=[table, pieces])
