"""Copy paths within one GPU, beside one `copy_` of the same bytes (a tool: the figures of
BENCHMARKS.md's "Executor" rows on one GPU, not a benchmark with a tiny mode).

    python scripts/copy_paths.py --kernels 64x4,1024x1,64x16,64x64,4096x1
    python scripts/copy_paths.py --engines 64x4,64x16,1024x1,64x64
    python scripts/copy_paths.py --launch

Each row is W writes of M MiB, chunk i to slot (i * 7) % W of another buffer on the same GPU
(as `bench/executor_bench.py`), every result checked bit-exact.
`--kernels`: CUDA events over graph replays of the copy kernel's builds (plain, the L2
256-byte prefetch hint, 8 loads in flight; 256 KiB and 32 KiB pieces) and of a Hopper bulk
copy kernel (`cp.async.bulk` global -> shared -> global on an mbarrier pipeline, one
thread a block issuing; tile, stages and blocks per SM varied), against one `copy_`
captured in a graph and one eager.
`--engines`: eager posts (events around the host's posts): one `cudaMemcpyAsync` a write
on 1, 2 or 4 streams, the copy kernel, and both at once (a share of the writes on the
engines, the rest on the kernel).
`--graphs`: the writes as copies captured in one CUDA graph (the copy engines without
the host's time a copy) on 1, 2, 4 and 8 branches, beside the kernel.
`--launch`: the host time of one post of the copy kernel: a launch of its one-node CUDA
graph, one `cuLaunchKernel` through ctypes, torch's `_CudaKernel` call.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from functools import partial

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from executor.gpu.copy_kernel import SOURCE, CopyKernel, piece_table  # noqa: E402
from executor.gpu.cuda_runtime import load_cudart  # noqa: E402
from scripts.cuda_timing import eager_timed, graph_timed  # noqa: E402

BULK_SOURCE = r"""
#ifndef RPLAN_TILE
#define RPLAN_TILE 32768
#endif
#ifndef RPLAN_STAGES
#define RPLAN_STAGES 4
#endif
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
extern "C" __global__ void rplan_bulk_copy(const long long* __restrict__ table, int pieces) {
  extern __shared__ __align__(128) unsigned char buf[];
  __shared__ __align__(8) unsigned long long bar[RPLAN_STAGES];
  if (threadIdx.x != 0 || (int)blockIdx.x >= pieces) return;
  const unsigned base = smem_addr(buf), bars = smem_addr(bar);
  for (int s = 0; s < RPLAN_STAGES; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bars + 8 * s) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int mine = (pieces - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
  #define ROW(k) (3 * (long long)((int)blockIdx.x + (k) * (int)gridDim.x))
  #define LOAD(k) do { const int s_ = (k) % RPLAN_STAGES; const long long r_ = ROW(k); \
      const unsigned n_ = (unsigned)table[r_ + 2]; const unsigned b_ = bars + 8 * s_; \
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" \
                   :: "r"(b_), "r"(n_) : "memory"); \
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes " \
                   "[%0], [%1], %2, [%3];" :: "r"(base + s_ * RPLAN_TILE), \
                   "l"(table[r_ + 1]), "r"(n_), "r"(b_) : "memory"); } while (0)
  for (int k = 0; k < mine && k < RPLAN_STAGES; ++k) LOAD(k);
  for (int k = 0; k < mine; ++k) {
    const int s = k % RPLAN_STAGES;
    const unsigned phase = (unsigned)((k / RPLAN_STAGES) & 1);
    asm volatile("{\n .reg .pred p;\n WAIT:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 " @!p bra WAIT;\n}" :: "r"(bars + 8 * s), "r"(phase) : "memory");
    const long long r = ROW(k);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(table[r]), "r"(base + s * RPLAN_TILE), "r"((unsigned)table[r + 2])
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k >= 1 && k - 1 + RPLAN_STAGES < mine) {  // refill the stage the last store read
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      LOAD(k - 1 + RPLAN_STAGES);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

L2HINT = SOURCE.replace("#define LOAD4(p) (*(p))", r"""
__device__ __forceinline__ uint4 ld_hint(const uint4* p) {
  uint4 v; asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
  : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)); return v; }
#define LOAD4(p) ld_hint(p)""")
BULK_SHAPES = [(32768, 4, 1), (16384, 4, 2), (32768, 6, 1), (65536, 3, 1), (16384, 6, 2),
               (8192, 8, 2), (32768, 3, 2)]
"""(tile bytes, stages, blocks per SM) of the bulk copy kernel."""


def rows(spec: str, dev: torch.device):
    """Per row: its name, writes, bytes each, source, destination, the wanted result and
    the write's destination and source addresses."""
    for row in spec.split(","):
        w, mib = row.split("x")
        writes, size = int(w), int(float(mib) * 2**20)
        src = torch.randint(0, 256, (writes * size,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        slot = torch.tensor([(i * 7) % writes for i in range(writes)], device=dev)
        want = src.view(writes, size)[slot.argsort()].reshape(-1)
        s = src.data_ptr() + np.arange(writes, dtype=np.int64) * size
        d = dst.data_ptr() + (np.arange(writes, dtype=np.int64) * 7 % writes) * size
        yield row, writes, size, src, dst, want, d, s


def show(row: str, n: int, one: float, res: list) -> None:
    for label, t, ok in res:
        print(f"| {row} | {label} | {t * 1e6:.1f} | {n / t / 1e9:.0f} | {one / t:.3f} | "
              f"{'-' if ok is None else ('yes' if ok else 'NO')} |", flush=True)


def kernels(spec: str, dev: torch.device) -> None:
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ck = torch.cuda._compile_kernel
    sm = {"sm": CopyKernel.load(dev).fn, "sm l2hint": ck(L2HINT, "rplan_copy"),
          "sm unroll8": ck(SOURCE, "rplan_copy", nvcc_options=["-DRPLAN_UNROLL=8"])}
    bulk = {}
    for tile, stages, bps in BULK_SHAPES:
        fn = ck(BULK_SOURCE, "rplan_bulk_copy",
                nvcc_options=[f"-DRPLAN_TILE={tile}", f"-DRPLAN_STAGES={stages}"])
        if tile * stages >= 48 * 1024:
            fn.set_shared_memory_config(tile * stages)
        bulk[(tile, stages, bps)] = fn
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, torch {torch.__version__}")
    print("| row | variant | us | GB/s | x copy_ (graph) | exact |\n| --- | --- | ---: | ---: "
          "| ---: | --- |")
    for row, writes, size, src, dst, want, d, s in rows(spec, dev):
        sizes = np.full(writes, size, dtype=np.int64)
        one = graph_timed(partial(dst.copy_, src))
        res = [("one copy_ (graph)", one, None),
               ("one copy_ (eager)", graph_timed(partial(dst.copy_, src), graph=False), None)]
        for name, fn in sm.items():
            for chunk in (1 << 18, 1 << 15):
                table = torch.from_numpy(piece_table(d, s, sizes, chunk)).to(dev)
                dst.zero_()
                t = graph_timed(partial(fn, grid=(min(len(table), sms * 4), 1, 1),
                                        block=(512, 1, 1), args=[table, len(table)]))
                res.append((f"{name} chunk {chunk >> 10}K", t, torch.equal(dst, want)))
        for (tile, stages, bps), fn in bulk.items():
            table = torch.from_numpy(piece_table(d, s, sizes, tile)).to(dev)
            dst.zero_()
            t = graph_timed(partial(fn, grid=(min(len(table), sms * bps), 1, 1),
                                    block=(32, 1, 1), args=[table, len(table)],
                                    shared_mem=tile * stages))
            res.append((f"bulk tile {tile >> 10}K x{stages} {bps}/SM", t,
                        torch.equal(dst, want)))
        show(row, writes * size, one, res)


def engines(spec: str, dev: torch.device) -> None:
    rt, k = load_cudart(), CopyKernel.load(dev)
    sides = [torch.cuda.Stream(dev) for _ in range(4)]
    print("| row | variant | us | GB/s | x eager copy_ | exact |\n| --- | --- | ---: | ---: | "
          "---: | --- |")
    for row, writes, size, src, dst, want, d, s in rows(spec, dev):
        raw = list(zip(d.tolist(), s.tolist(), [size] * writes))
        one = eager_timed(partial(dst.copy_, src))

        def post(nstreams: int, part: list, table: torch.Tensor | None = None) -> None:
            main, use = torch.cuda.current_stream(), sides[:nstreams]
            for st in use:
                st.wait_stream(main)
            for i, (dd, ss, nn) in enumerate(part):
                rt.memcpy_async(dd, ss, nn, 3, use[i % nstreams].cuda_stream)
            if table is not None:
                k.launch(table)
            for st in use:
                main.wait_stream(st)

        res = [("one copy_ (eager)", one, None)]
        for ns in (1, 2, 4):
            dst.zero_()
            res.append((f"engines eager, {ns} stream(s)", eager_timed(partial(post, ns, raw)),
                        torch.equal(dst, want)))
        table = torch.from_numpy(piece_table(d, s, np.full(writes, size, np.int64))).to(dev)
        dst.zero_()
        res.append(("kernel", eager_timed(partial(k.launch, table)), torch.equal(dst, want)))
        for share in (0.1, 0.2, 0.3, 0.5):
            m = max(1, int(round(writes * share)))
            rest = torch.from_numpy(piece_table(d[m:], s[m:], np.full(writes - m, size,
                                                                      np.int64))).to(dev)
            for ns in (1, 2):
                dst.zero_()
                res.append((f"hybrid: {m} writes on engines ({ns} st), rest kernel",
                            eager_timed(partial(post, ns, raw[:m], rest)),
                            torch.equal(dst, want)))
        show(row, writes * size, one, res)


def graphs(spec: str, dev: torch.device, counts: tuple[int, ...] = (1, 2, 4, 8),
           mix: tuple[float, ...] = ()) -> None:
    """The writes as `cudaMemcpyAsync` copies captured in one CUDA graph (copy engines, no
    host time a copy) on `counts` parallel branches, beside one eager `copy_` and the
    kernel; `mix`: shares of the writes on the engines (the most branches of `counts`)
    while the kernel copies the rest, both in one graph."""
    rt, k = load_cudart(), CopyKernel.load(dev)
    print("| row | variant | us | GB/s | x eager copy_ | exact |\n| --- | --- | ---: | ---: | "
          "---: | --- |")
    for row, writes, size, src, dst, want, d, s in rows(spec, dev):
        raw = list(zip(d.tolist(), s.tolist(), [size] * writes))
        one = eager_timed(partial(dst.copy_, src))
        res = [("one copy_ (eager)", one, None)]
        def post(sides: list[torch.cuda.Stream], raw: list[tuple[int, int, int]],
                 table: torch.Tensor | None = None) -> None:
            main = torch.cuda.current_stream()
            for st in sides:
                st.wait_stream(main)
            for i, (dd, ss, nn) in enumerate(raw):
                assert not rt.memcpy_async(dd, ss, nn, 3, sides[i % len(sides)].cuda_stream)
            if table is not None:  # the kernel's share, on the main branch meanwhile
                k.launch(table)
            for st in sides:
                main.wait_stream(st)

        for nb in counts:
            sides = [torch.cuda.Stream(dev) for _ in range(nb)]
            dst.zero_()
            res.append((f"engines, one graph, {nb} branch(es)", graph_timed(
                partial(post, sides, raw)), torch.equal(dst, want)))
        table = torch.from_numpy(piece_table(d, s, np.full(writes, size, np.int64))).to(dev)
        dst.zero_()
        res.append(("kernel (graph)", graph_timed(partial(k.launch, table)),
                    torch.equal(dst, want)))
        for share in mix:
            cut = int(round(writes * share))
            rest = torch.from_numpy(piece_table(d[cut:], s[cut:], np.full(
                writes - cut, size, np.int64))).to(dev)
            sides = [torch.cuda.Stream(dev) for _ in range(max(counts))]
            dst.zero_()
            res.append((f"{share:g} engines ({len(sides)} branches) + kernel, one graph",
                        graph_timed(partial(post, sides, raw[:cut], rest)),
                        torch.equal(dst, want)))
        show(row, writes * size, one, res)


def launch(dev: torch.device) -> None:
    rt, k = load_cudart(), CopyKernel.load(dev)
    lib = ctypes.PyDLL("libcuda.so.1")
    cu_launch = lib.cuLaunchKernel
    u = ctypes.c_uint
    cu_launch.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_void_p]
    cu_launch.restype = ctypes.c_int
    for row, writes, size, _src, dst, want, d, s in rows("64x4,1024x1", dev):
        table = k.table(d, s, np.full(writes, size, dtype=np.int64))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            k.launch(table)
        exe = g.raw_cuda_graph_exec()
        keep = [ctypes.c_void_p(table.data_ptr()), ctypes.c_int(len(table))]
        params = (ctypes.c_void_p * 2)(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
                                         for v in keep])
        grid = min(len(table), k.max_blocks)
        stream = torch.cuda.Stream(dev)
        sid = stream.cuda_stream
        ways = {"graph launch (cudaGraphLaunch)": partial(rt.graph_launch, exe, sid),
                "cuLaunchKernel (ctypes)": partial(cu_launch, k.fn.func, grid, 1, 1, 512, 1, 1,
                                                   0, sid, params, None),
                "torch _CudaKernel call": None}
        for name, fn in ways.items():
            host, gpu = [], []
            for _ in range(30):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                t0 = time.perf_counter()
                if fn is None:
                    with torch.cuda.stream(stream):
                        k.launch(table)
                else:
                    assert fn() == 0
                host.append(time.perf_counter() - t0)
                b.record(stream)
                b.synchronize()
                gpu.append(a.elapsed_time(b) / 1e3)
            print(f"{row} | {name} | host us per post {statistics.median(host) * 1e6:.1f} | "
                  f"event-to-event us {statistics.median(gpu) * 1e6:.1f} | exact "
                  f"{torch.equal(dst, want)}", flush=True)
            dst.zero_()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", help="rows WxM (writes x MiB), comma-separated")
    ap.add_argument("--engines", help="rows WxM")
    ap.add_argument("--graphs", help="rows WxM: the writes as copies in one CUDA graph")
    ap.add_argument("--branches", default="1,2,4,8",
                    help="--graphs: branch counts of the engine graphs, comma-separated")
    ap.add_argument("--mix", default="",
                    help="--graphs: shares of the writes on the engines beside the kernel")
    ap.add_argument("--launch", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    if a.kernels:
        kernels(a.kernels, dev)
    if a.engines:
        engines(a.engines, dev)
    if a.graphs:
        graphs(a.graphs, dev, tuple(int(b) for b in a.branches.split(",")),
               tuple(float(m) for m in a.mix.split(",") if m))
    if a.launch:
        launch(dev)


if __name__ == "__main__":
    main()
