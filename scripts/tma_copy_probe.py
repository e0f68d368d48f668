"""Other ways to run the batched copy kernel, against the shipped LD/ST kernel and one `copy_`
(in a graph: one copy-engine copy; eager: what the driver does with one large copy), for the
writes of `bench/executor_bench.py` (chunk i to slot (i * 7) % W). A tool that picks nothing:
it says whether a kernel shape moves the bytes faster. Needs a GPU with bulk copies (sm_90+).

    python scripts/tma_copy_probe.py [--rows 1024x1,4096x1,64x4,64x16] [--chunks 256,1024]
                                     [--variants NAMES] [--reps 20]

- TMA: each block one thread issuing Hopper's bulk copies (`cp.async.bulk` global -> shared
  -> global) through a ring of NST shared-memory stages of SZ bytes, NSTORE stores in flight
  (`VARIANTS`: stages, stage bytes, stores, blocks per SM); heads, tails and misaligned
  pieces by the block's 32 threads.
- LD/ST with L2 evict-first hints on its loads ("ef loads") or loads and stores ("ef both"),
  or its loads non-coherent with a 256-byte L2 prefetch ("L2::256B loads").
Each result is checked bit-exact; times are CUDA events over graph replays (medians).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from executor.gpu.copy_kernel import SOURCE, piece_table  # noqa: E402
from scripts.cuda_timing import Scrambled, graph_timed  # noqa: E402

TMA = r"""
#ifndef NST
#define NST 4
#endif
#ifndef SZ
#define SZ 12288
#endif
#ifndef NSTORE
#define NSTORE 1
#endif
#define NLOAD (NST - NSTORE)
struct Cur { long long c; long long off, len; const unsigned char* s; unsigned char* d; };
__device__ __forceinline__ bool rp_piece(const long long* table, long long pieces, Cur& u) {
  for (; u.c < pieces; u.c += gridDim.x) {
    unsigned char* dst = (unsigned char*)table[3 * u.c];
    const unsigned char* src = (const unsigned char*)table[3 * u.c + 1];
    const long long n = table[3 * u.c + 2];
    if ((((unsigned long long)dst ^ (unsigned long long)src) & 15ULL) != 0ULL) continue;
    long long head = (long long)((16ULL - ((unsigned long long)dst & 15ULL)) & 15ULL);
    if (head > n) head = n;
    const long long body = (n - head) & ~15LL;
    if (body > 0) { u.d = dst + head; u.s = src + head; u.len = body; u.off = 0; return true; }
  }
  return false;
}
__device__ __forceinline__ bool rp_next(const long long* table, long long pieces, Cur& u) {
  u.off += SZ;
  if (u.off < u.len) return true;
  u.c += gridDim.x;
  return rp_piece(table, pieces, u);
}
__device__ __forceinline__ unsigned rp_smem(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void rp_load(unsigned m, const void* g, unsigned n, unsigned b) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               :: "r"(b), "r"(n) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1], %2, [%3];" :: "r"(m), "l"(g), "r"(n), "r"(b) : "memory");
}
__device__ __forceinline__ void rp_wait(unsigned b, unsigned par) {
  unsigned ok = 0;
  while (!ok) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                 " selp.u32 %0, 1, 0, p; }" : "=r"(ok) : "r"(b), "r"(par) : "memory");
  }
}
__device__ __forceinline__ void rp_store(void* g, unsigned m, unsigned n) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               :: "l"(g), "r"(m), "r"(n) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
extern "C" __global__ void __launch_bounds__(32) rplan_copy_tma(
    const long long* __restrict__ table, int pieces) {
  extern __shared__ __align__(128) unsigned char buf[];  // NST stages of SZ bytes
  __shared__ __align__(8) unsigned long long bar[NST];
  const int t = threadIdx.x;
  // bytes outside a 16-byte body: misaligned pieces, heads and tails (all 32 threads)
  for (long long c = blockIdx.x; c < pieces; c += gridDim.x) {
    unsigned char* dst = (unsigned char*)table[3 * c];
    const unsigned char* src = (const unsigned char*)table[3 * c + 1];
    const long long n = table[3 * c + 2];
    if ((((unsigned long long)dst ^ (unsigned long long)src) & 15ULL) != 0ULL) {
      for (long long i = t; i < n; i += 32) dst[i] = src[i];
      continue;
    }
    long long head = (long long)((16ULL - ((unsigned long long)dst & 15ULL)) & 15ULL);
    if (head > n) head = n;
    const long long end = head + ((n - head) & ~15LL);
    for (long long i = t; i < head; i += 32) dst[i] = src[i];
    for (long long i = end + t; i < n; i += 32) dst[i] = src[i];
  }
  if (t != 0) return;
  for (int i = 0; i < NST; ++i) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(rp_smem(&bar[i])) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  Cur L, S;
  L.c = S.c = blockIdx.x;
  bool lv = rp_piece(table, pieces, L), sv = rp_piece(table, pieces, S);
  long long kl = 0, ks = 0;
  for (; lv && kl < NLOAD; ++kl) {
    const int st = (int)(kl % NST);
    const long long r = L.len - L.off;
    rp_load(rp_smem(buf + st * SZ), L.s + L.off, (unsigned)(r < SZ ? r : SZ), rp_smem(&bar[st]));
    lv = rp_next(table, pieces, L);
  }
  while (sv) {
    const int st = (int)(ks % NST);
    rp_wait(rp_smem(&bar[st]), (unsigned)((ks / NST) & 1));
    const long long r = S.len - S.off;
    rp_store(S.d + S.off, rp_smem(buf + st * SZ), (unsigned)(r < SZ ? r : SZ));
    sv = rp_next(table, pieces, S);
    ++ks;
    if (lv) {  // the stage of store ks - 1 - NSTORE: read out once NSTORE stores remain
      asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(NSTORE) : "memory");
      const int sl = (int)(kl % NST);
      const long long rl = L.len - L.off;
      rp_load(rp_smem(buf + sl * SZ), L.s + L.off, (unsigned)(rl < SZ ? rl : SZ),
              rp_smem(&bar[sl]));
      lv = rp_next(table, pieces, L);
      ++kl;
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

HINTS = r"""
__device__ __forceinline__ uint4 rp_ld(const uint4* p, unsigned long long pol) {
  uint4 v;
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ void rp_st(uint4* p, uint4 v, unsigned long long pol) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol) : "memory");
}
__device__ __forceinline__ uint4 rp_ld256(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
#if RPLAN_EVICT_STORES
#define STORE4(p, v) rp_st(p, v, pol)
#else
#define STORE4(p, v) (*(p) = (v))
#endif
#if RPLAN_PREFETCH
#define LOAD4(p) rp_ld256(p)
#else
#define LOAD4(p) rp_ld(p, pol)
#endif
"""
HINTED = SOURCE.replace(SOURCE[SOURCE.index("#if RPLAN_STREAMING"):SOURCE.index("#endif") + 7],
                        HINTS).replace(
    "  const long long t = threadIdx.x, bd = blockDim.x;\n",
    "  const long long t = threadIdx.x, bd = blockDim.x;\n  unsigned long long pol;\n"
    "  asm volatile(\"createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\" : \"=l\"(pol));\n")
"""The LD/ST kernel, L2 evict-first hints on its loads (stores too: `RPLAN_EVICT_STORES`)."""

# name -> (NST, SZ, NSTORE, blocks per SM); shared memory NST * SZ a block
VARIANTS = {"4x12K s1 4/SM": (4, 12 << 10, 1, 4), "6x8K s2 4/SM": (6, 8 << 10, 2, 4),
            "8x6K s3 4/SM": (8, 6 << 10, 3, 4), "4x24K s1 2/SM": (4, 24 << 10, 1, 2),
            "8x12K s3 2/SM": (8, 12 << 10, 3, 2), "6x32K s2 1/SM": (6, 32 << 10, 2, 1),
            "12x16K s4 1/SM": (12, 16 << 10, 4, 1), "8x8K s3 3/SM": (8, 8 << 10, 3, 3),
            "16x4K s6 4/SM": (16, 4 << 10, 6, 4)}


SPIN = r"""
extern "C" __global__ void rplan_spin(int cycles) {  // torch passes a Python int as an int
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}
"""


def engine_check(dev: torch.device, sms: int, nbytes: int = 1 << 30) -> None:
    """Whether one eager `copy_` within the GPU runs on the SMs: it is posted on its own
    stream while a kernel holds every SM for ~5 ms; a copy engine's copy ends long before
    the spinning kernel, a copy on the SMs after it (the profiler's "Memcpy DtoD" label does
    not say which)."""
    spin = torch.cuda._compile_kernel(SPIN, "rplan_spin")
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    side, hold = torch.cuda.Stream(dev), torch.cuda.Stream(dev)  # neither waits for the other
    rate = torch.cuda.get_device_properties(dev).clock_rate * 1e3 if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1.98e9
    for label, busy in (("idle GPU", False), ("every SM held ~5 ms", True)):
        dst.copy_(src)
        torch.cuda.synchronize()
        a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        hold.wait_event(a)
        with torch.cuda.stream(hold):
            if busy:
                spin(grid=(sms * 8, 1, 1), block=(256, 1, 1), args=[int(rate * 5e-3)])
            c.record(hold)
        side.wait_event(a)
        with torch.cuda.stream(side):
            dst.copy_(src)
            b.record(side)
        torch.cuda.synchronize()
        print(f"eager copy_ of {nbytes >> 20} MiB, {label}: ends {a.elapsed_time(b) * 1e3:.0f} us "
              f"after the start, the spinning kernel {a.elapsed_time(c) * 1e3:.0f} us",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1024x1,4096x1,64x4,64x16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ldst-bps", default="4", help="LD/ST kernel grids, blocks per SM")
    ap.add_argument("--engine-check", action="store_true",
                    help="first, whether one eager copy_ runs on the SMs (`engine_check`)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--chunks", default="256")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, torch {torch.__version__}", flush=True)
    if a.engine_check:
        engine_check(dev, sms)
    old = {"LD/ST": torch.cuda._compile_kernel(SOURCE, "rplan_copy")}
    for name, opts in (("LD/ST streaming", ["-DRPLAN_STREAMING=1"]),
                       ("LD/ST unroll 8", ["-DRPLAN_UNROLL=8"]),
                       ("LD/ST unroll 16", ["-DRPLAN_UNROLL=16"])):
        old[name] = torch.cuda._compile_kernel(SOURCE, "rplan_copy", nvcc_options=opts)
    for name, opts in (("LD/ST L2::256B loads", ["-DRPLAN_PREFETCH=1"]),
                       ("LD/ST L2::256B loads unroll 8", ["-DRPLAN_PREFETCH=1",
                                                          "-DRPLAN_UNROLL=8"])):
        old[name] = torch.cuda._compile_kernel(HINTED, "rplan_copy", nvcc_options=opts)
    for name, opts in (("LD/ST ef loads", []), ("LD/ST ef both", ["-DRPLAN_EVICT_STORES=1"])):
        try:
            old[name] = torch.cuda._compile_kernel(HINTED, "rplan_copy", nvcc_options=opts)
        except Exception as e:  # noqa: BLE001
            print(name, "did not build:", str(e)[:2000], flush=True)
    tma = {}
    for name in a.variants.split(","):
        nst, sz, ns, bps = VARIANTS[name]
        try:
            fn = torch.cuda._compile_kernel(TMA, "rplan_copy_tma", nvcc_options=[
                f"-DNST={nst}", f"-DSZ={sz}", f"-DNSTORE={ns}"])
            if nst * sz >= 48 << 10:
                fn.set_shared_memory_config(nst * sz)
            tma[name] = (fn, nst * sz, bps)
        except Exception as e:  # noqa: BLE001
            print(name, "did not build:", str(e)[:2000], flush=True)
    print("| row | variant | us | GB/s | x one copy_ | exact |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for row in a.rows.split(","):
        sc = Scrambled(row, dev)
        n, src, dst, want = sc.n, sc.src, sc.dst, sc.want
        s, d, sizes = sc.s, sc.d, sc.sizes
        one = graph_timed(partial(dst.copy_, src), a.reps)
        res = [("one copy_", one, None), ("one copy_, eager", graph_timed(
            partial(dst.copy_, src), a.reps, graph=False), None)]
        for chunk in [int(c) << 10 for c in a.chunks.split(",")]:
            table = torch.from_numpy(piece_table(d, s, sizes, chunk)).to(dev)
            for bps in map(int, a.ldst_bps.split(",")):
                grid = min(len(table), sms * bps)
                for name, fn in old.items():
                    dst.zero_()
                    res.append((f"{name} kernel {chunk >> 10}K {bps}/SM 512", graph_timed(
                        partial(fn, grid=(grid, 1, 1), block=(512, 1, 1),
                                args=[table, len(table)]), a.reps), torch.equal(dst, want)))
            for name, (fn, smem, bps) in tma.items():
                dst.zero_()
                grid = min(len(table), sms * bps)
                t = graph_timed(partial(fn, grid=(grid, 1, 1), block=(32, 1, 1),
                                        args=[table, len(table)], shared_mem=smem), a.reps)
                res.append((f"TMA {name} {chunk >> 10}K", t, torch.equal(dst, want)))
        for label, t, ok in res:
            print(f"| {row} | {label} | {t * 1e6:.1f} | {n / t / 1e9:.0f} | {one / t:.3f} | "
                  f"{'-' if ok is None else ('yes' if ok else 'NO')} |", flush=True)
        del src, dst, want


if __name__ == "__main__":
    main()
