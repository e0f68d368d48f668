"""Tune the batched copy kernel on a GPU (a tool, not a benchmark: it picks constants).

    python scripts/tune_copy_kernel.py [--rows 64x4,64x16,64x64,1024x1,4096x1] [--quick]

For each row (writes x MiB, chunk i to slot (i * 7) % writes of another buffer on the same
GPU, as `bench/executor_bench.py` does) it times, with CUDA events over graph replays, one
`copy_` of all the bytes, the copy engines (4 branches, one `cudaMemcpyAsync` per write, as
`cuda_ipc` captures them) and the kernel at several launch shapes and builds (4 or 8 loads in
flight per thread, plain or streaming loads), checks each result bit-exact, and prints the
ratio to the one copy. `--quick`: fewer launch shapes.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from executor.gpu.copy_kernel import SOURCE, CopyKernel, piece_table  # noqa: E402
from executor.gpu.cuda_runtime import load_cudart  # noqa: E402
from executor.transports.cuda_ipc import branches  # noqa: E402
from scripts.cuda_timing import Scrambled, graph_timed  # noqa: E402

REPS = 20
"""Timed replays of each variant (their median is its time)."""


def engines(rt, raw: list[tuple[int, int, int]]) -> None:
    """The copies as 4 branches of `cudaMemcpyAsync`s (what `cuda_ipc` captures)."""
    main_s = torch.cuda.current_stream()
    sides = [torch.cuda.Stream() for _ in range(4)]
    for side, part in zip(sides, branches(raw, 4)):
        side.wait_stream(main_s)
        for dd, ss, nn in part:
            rt.memcpy_async(dd, ss, nn, 3, side.cuda_stream)
        main_s.wait_stream(side)


BUILDS = {"plain": [], "streaming": ["-DRPLAN_STREAMING=1"], "unroll8": ["-DRPLAN_UNROLL=8"],
          "unroll8 streaming": ["-DRPLAN_UNROLL=8", "-DRPLAN_STREAMING=1"]}
"""Kernel builds tried: name -> NVRTC options."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64x4,64x16,64x64,1024x1,4096x1")
    ap.add_argument("--quick", action="store_true",
                    help="chunks 256K and 1M, 2 and 4 blocks per SM, 512 threads only")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    rt = load_cudart()
    base = CopyKernel.load(dev)
    assert base is not None
    kernels = {}
    for name, opts in BUILDS.items():
        try:
            kernels[name] = base.fn if not opts else torch.cuda._compile_kernel(
                SOURCE, "rplan_copy", nvcc_options=opts)
        except Exception as e:  # noqa: BLE001
            print(f"{name} variant did not build:", e)
    chunks = (1 << 18, 1 << 20) if a.quick else (1 << 16, 1 << 18, 1 << 20)
    shapes = [(2, 512), (4, 512)] if a.quick else [(b, t) for b in (1, 2, 4, 8)
                                                   for t in (256, 512)]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, torch {torch.__version__}")
    print("| row | variant | s | GB/s | x one copy_ | exact |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for row in a.rows.split(","):
        sc = Scrambled(row, dev)
        n, src, dst, want = sc.n, sc.src, sc.dst, sc.want
        s, d, sizes = sc.s, sc.d, sc.sizes
        one = graph_timed(partial(dst.copy_, src), REPS)
        results = [("one copy_", one, None)]

        dst.zero_()
        raw = list(zip(d.tolist(), s.tolist(), sizes.tolist()))
        results.append(("engines, 4 branches", graph_timed(partial(engines, rt, raw), REPS),
                        torch.equal(dst, want)))
        for name, fn in kernels.items():
            for chunk in chunks:
                table = torch.from_numpy(piece_table(d, s, sizes, chunk)).to(dev)
                for bps, threads in shapes:
                    grid = min(len(table), sms * bps)
                    dst.zero_()
                    t = graph_timed(partial(fn, grid=(grid, 1, 1), block=(threads, 1, 1),
                                            args=[table, len(table)]), REPS)
                    results.append((f"kernel {name} chunk {chunk >> 10}K {bps}/SM "
                                    f"{threads} thr", t, torch.equal(dst, want)))
        for label, t, ok in results:
            print(f"| {row} | {label} | {t:.6f} | {n / t / 1e9:.0f} | {one / t:.2f} | "
                  f"{'-' if ok is None else ('yes' if ok else 'NO')} |", flush=True)


if __name__ == "__main__":
    main()
