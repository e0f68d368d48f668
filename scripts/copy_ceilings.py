"""What each way of copying a step's writes costs the GPU itself, beside one raw copy of the
same bytes (a tool: the ceilings of BENCHMARKS.md's "Executor" rows, not a benchmark with a
tiny mode).

    python3 scripts/copy_ceilings.py           # one GPU: both buffers on cuda:0
    python3 scripts/copy_ceilings.py --peer    # NVLink: cuda:0 writes into cuda:1

Each row is W writes of M MiB (64 x 4 and 1024 x 1), chunk i to slot (i * 7) % W of the other
buffer (as `bench/executor_bench.py`), posted one way, timed three ways (medians of `--reps`):
`pure`, between two CUDA events with the posts queued behind a GPU sleep (the GPU's own time,
whatever the host's posting costs); `idle`, the same events with the GPU idle when the host
starts posting; and `host`, the host's posting call and, with it, the post and a sync (what
`executor_bench.py`'s raw baseline times). Every way's result is checked bit-exact once (the
raw copy: the source's bytes in order). The ways: copy-engine copies in one CUDA graph of K
branches (as `cuda_ipc` posts 4 MiB writes on one GPU), split into two or three graphs, the
copy kernel (`executor/gpu/copy_kernel.py`, as 1 MiB writes), a share of the writes on the
kernel and the rest on a 16-branch engine graph in one graph, and (`--peer`)
`cuMemcpyBatchAsync` in growing calls (as `cuda_ipc` posts into a peer on another GPU) or one
call; against one eager `copy_` (one GPU: the driver's device-to-device copy) or one
`cudaMemcpyAsync` (peer).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from executor.gpu.copy_kernel import CopyKernel  # noqa: E402
from executor.gpu.cuda_runtime import BatchCopies, load_cudart  # noqa: E402
from scripts.cuda_timing import Scrambled  # noqa: E402

SLEEP_CYCLES = 4_000_000  # ~2 ms of GPU sleep: every post is queued before the GPU reaches it


def timed(launch: Callable[[], object], stream: torch.cuda.Stream, reps: int,
          behind_sleep: bool = False) -> tuple[float, float, float]:
    """(us between the events, us of the host's posting call, us of post + sync), medians."""
    gpu, host, wall = [], [], []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            if behind_sleep:
                torch.cuda._sleep(SLEEP_CYCLES)
            t0 = time.perf_counter()
            a.record(stream)
            launch()
            t1 = time.perf_counter()
            b.record(stream)
        b.synchronize()
        t2 = time.perf_counter()
        gpu.append(a.elapsed_time(b) * 1e3)
        host.append((t1 - t0) * 1e6)
        wall.append((t2 - t0) * 1e6)
    return (statistics.median(gpu[2:]), statistics.median(host[2:]),
            statistics.median(wall[2:]))


class Rows:
    """One size's buffers (`Scrambled`) and its ways of copying."""

    def __init__(self, rt, row: str, src_dev: torch.device, dst_dev: torch.device,
                 stream: torch.cuda.Stream) -> None:
        self.rt, self.stream, self.dev = rt, stream, src_dev
        sc = Scrambled(row, src_dev, dst_dev)
        self.writes, self.src, self.dst, self.want = sc.writes, sc.src, sc.dst, sc.want
        self.raw = list(zip(sc.d.tolist(), sc.s.tolist(), sc.sizes.tolist()))
        self.keep: list[object] = []  # graphs, tables, call arrays: alive while replayed

    def engines(self, raw: list[tuple[int, int, int]], branches: int) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        sides = [torch.cuda.Stream(self.dev) for _ in range(branches)]
        with torch.cuda.graph(g, stream=self.stream):
            for s in sides:
                s.wait_stream(self.stream)
            for i, (d, s_, n) in enumerate(raw):
                if self.rt.memcpy_async(d, s_, n, self.rt.D2D, sides[i % branches].cuda_stream):
                    raise RuntimeError("cudaMemcpyAsync failed in capture")
            for s in sides:
                self.stream.wait_stream(s)
        self.keep.append(g)
        return g

    def kernel(self, kern: CopyKernel, raw: list[tuple[int, int, int]],
               engines_after: int = -1) -> torch.cuda.CUDAGraph:
        """The copy kernel over `raw[:engines_after]`, the rest on a 16-branch engine graph
        beside it, in one graph (all of `raw` on the kernel by default)."""
        cut = len(raw) if engines_after < 0 else engines_after
        d, s, n = (np.array([r[k] for r in raw[:cut]], dtype=np.int64) for k in range(3))
        table = kern.table(d, s, n)
        g = torch.cuda.CUDAGraph()
        sides = [torch.cuda.Stream(self.dev) for _ in range(16)] if cut < len(raw) else []
        with torch.cuda.graph(g, stream=self.stream):
            for x in sides:
                x.wait_stream(self.stream)
            kern.launch(table, 1.0)
            for i, (dd, ss, m) in enumerate(raw[cut:]):
                if self.rt.memcpy_async(dd, ss, m, self.rt.D2D, sides[i % 16].cuda_stream):
                    raise RuntimeError("cudaMemcpyAsync failed in capture")
            for x in sides:
                self.stream.wait_stream(x)
        self.keep += [g, table]
        return g

    def check(self, name: str, fn: Callable[[], object]) -> None:
        """`fn`'s copies land as they should: the writes in their scrambled slots, the raw
        copy (`raw: ...`) the source's bytes as they are."""
        self.dst.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.synchronize()
        want = self.src.to(self.dst.device) if name.startswith("raw") else self.want
        if not torch.equal(self.dst, want):
            raise SystemExit(f"{self.writes} writes, {name}: the copied bytes differ")


def ways(r: Rows, kern: CopyKernel | None, peer: bool) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {}
    for k in ((4, 16) if peer else (1, 4, 16)):
        out[f"engines, one graph of {k} branches"] = r.engines(r.raw, k).replay
    if not peer and r.writes == 64:
        a, b = r.engines(r.raw[:8], 4), r.engines(r.raw[8:], 16)
        out["engines, graphs of 8 (4 br) + 56 (16 br)"] = lambda: (a.replay(), b.replay())
        c, d, e = r.engines(r.raw[:4], 4), r.engines(r.raw[4:16], 12), r.engines(r.raw[16:], 16)
        out["engines, graphs of 4 + 12 + 48"] = lambda: (c.replay(), d.replay(), e.replay())
    if kern is not None:
        out["copy kernel"] = r.kernel(kern, r.raw).replay
        for share in ((0.5, 0.75) if peer else (0.6, 0.75, 0.9)):
            g = r.kernel(kern, r.raw, int(r.writes * share))
            out[f"kernel {share:.2f} + engines (16 br)"] = g.replay
    if peer:
        batch = BatchCopies.load()
        if batch is not None:
            cols = [[x[k] for x in r.raw] for k in range(3)]
            grow, one = batch.prepare(*cols, 4, 128), batch.prepare(*cols, 4096, 4096)
            r.keep += [grow, one]
            sid = r.stream.cuda_stream
            out["cuMemcpyBatchAsync, growing calls"] = lambda: batch.post(grow, sid)
            out["cuMemcpyBatchAsync, one call"] = lambda: batch.post(one, sid)
        dst, src, n = r.dst.data_ptr(), r.src.data_ptr(), r.src.numel()
        out["raw: one cudaMemcpyAsync"] = lambda: r.rt.memcpy_async(dst, src, n, r.rt.D2D,
                                                                    r.stream.cuda_stream)
    else:
        out["raw: one eager copy_"] = lambda: r.dst.copy_(r.src)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", action="store_true", help="write into cuda:1 (NVLink)")
    ap.add_argument("--rows", default="64x4,1024x1", help="W x MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    rt = load_cudart()
    if rt is None or not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU and the CUDA runtime torch loaded")
    src_dev = torch.device("cuda:0")
    dst_dev = torch.device("cuda:1" if a.peer else "cuda:0")
    torch.cuda.set_device(src_dev)
    if a.peer:  # peer access both ways (torch enables it on a first copy between them)
        torch.zeros(4, device=src_dev).copy_(torch.zeros(4, device=dst_dev))
        torch.zeros(4, device=dst_dev).copy_(torch.zeros(4, device=src_dev))
        torch.cuda.synchronize()
    stream, kern = torch.cuda.Stream(src_dev), CopyKernel.load(src_dev)
    print(f"{torch.cuda.get_device_name(src_dev)}, {'cuda:0 -> cuda:1' if a.peer else 'one GPU'}"
          f", copy kernel {'built' if kern is not None else 'unavailable'}; us, medians of "
          f"{a.reps}", flush=True)
    print("| W x MiB | way | pure GPU us | GB/s | raw pure / pure | idle: events us | host "
          "post us | post + sync us |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in a.rows.split(","):
        r = Rows(rt, row, src_dev, dst_dev, stream)
        fns = ways(r, kern, a.peer)
        for name, fn in fns.items():
            r.check(name, fn)
        raw_name = next(k for k in fns if k.startswith("raw"))
        for _ in range(a.rounds):
            raw_pure = timed(fns[raw_name], stream, a.reps, behind_sleep=True)[0]
            for name, fn in fns.items():
                pure = timed(fn, stream, a.reps, behind_sleep=True)[0]
                idle, host, wall = timed(fn, stream, a.reps)
                print(f"| {row} | {name} | {pure:.1f} | {r.src.numel() / pure / 1e3:.0f} | "
                      f"{raw_pure / pure:.2f} | {idle:.1f} | {host:.1f} | {wall:.1f} |",
                      flush=True)
        del r, fns


if __name__ == "__main__":
    main()
