"""Probe: a step's READY taken off the source's host path by a GPU stream wait, on one GPU.

    python3 scripts/stream_wait_probe.py [--rows 64x4,1024x1] [--steps 30] [--rounds 2]
                                         [--per-batch 8] [--source-lag-us 0] [--target-lag-us 0]

Two processes on one GPU, as `bench/executor_bench.py --transport cuda_ipc` runs them: the
target owns `x` (W writes of M MiB, chunk i to slot (i * 7) % W) and hands it to the source
through CUDA IPC; both map one shared-memory page holding step counters (monotonic, never
reset). Each step the target's host stores READY = k in the page and spins until DONE >= k;
the source posts the W writes as `cuda_ipc` does, a CUDA graph a batch (copy-engine copies
on up to 16 branches for writes of 4 MiB and more, else the copy kernel; the batches across 4
copy streams in turn, each behind an event of the step's stream): `--per-batch 0` one batch
of all W (the executor fuses a stage's writes to one peer into one), `--per-batch 8` the
plan's batches of 8. Then it joins them on the step's stream, queues a stream write of
DONE = k behind them, and spins on the copies' event. `--source-lag-us` / `--target-lag-us`
stand in for the executor's own host work a step (its signals' checks, its bookkeeping):
busy time on the source between READY and the post (`host`; before the post in `gpu`, where
it is off the copies' path) and on the target between DONE and the next READY. Each round
runs the modes in turn, all against one eager `copy_` of the bytes (the executor bench's
raw baseline), and the target checks every mode's bytes:

- `host`: the source's host spins until READY >= k, then posts (the executor's order);
- `gpu`: the source posts at once, the copies behind `cuStreamWaitValue64(READY >= k)`
  (GEQ on the counter), its host never reading READY;
- `gpu2`: as `gpu`, READY stored by a `cuStreamWriteValue64` on the target's own stream
  (READY ordered behind the target's GPU work: two contexts on one GPU take turns);
- `raw`: one eager `copy_` and a sync.

Each step the target's host also times READY stored -> SEEN = k back in the page (stored by
the source's host in `host`; by a stream write right behind the wait in `gpu`): the hand-off's
latency there and back.
A last check: a wait that nobody satisfies, released after 20 ms by the host storing the
counter (the watchdog's release), and how long the stream took to notice. Needs a GPU.
Nothing here is used by the executor (BENCHMARKS.md: why its READY stays on the host).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import struct
import sys
import time

import numpy as np
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from executor.gpu.copy_kernel import CopyKernel  # noqa: E402
from executor.gpu.cuda_runtime import Runtime, StreamWrites  # noqa: E402
from executor.transports.ipc_posted import branches  # noqa: E402

READY, DONE, SEEN = 0, 64, 128  # counters' offsets in the page
WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
BRANCHES, ENGINES_MIN, STREAMS = 16, 4 << 20, 4  # the executor's defaults
MODES = ("host", "gpu", "gpu2")


def u64(page: mmap.mmap, off: int) -> int:
    return struct.unpack_from("<Q", page, off)[0]


def put(page: mmap.mmap, off: int, v: int) -> None:
    struct.pack_into("<Q", page, off, v)


def burn(us: float) -> None:
    """Keep the host busy `us` microseconds (a stand-in for a step's host work)."""
    if us > 0:
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass


def spin_geq(page: mmap.mmap, off: int, k: int, deadline_s: float = 30.0) -> None:
    end = time.perf_counter() + deadline_s
    while u64(page, off) < k:
        if time.perf_counter() > end:
            raise SystemExit(f"probe: counter at {off} stuck at {u64(page, off)} < {k}")


class Waits:
    """`cuStreamWaitValue64` of the driver (the `_v2` entry point where present)."""

    def __init__(self) -> None:
        lib = ctypes.PyDLL("libcuda.so.1")
        fn = getattr(lib, "cuStreamWaitValue64_v2", None) or lib.cuStreamWaitValue64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        self.fn = fn
        attr = lib.cuDeviceGetAttribute
        attr.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        v = ctypes.c_int(-1)
        # CUDA 13's cuda.h: 122 CAN_USE_64_BIT_STREAM_MEM_OPS, 123 CAN_USE_STREAM_WAIT_VALUE_NOR
        # (GEQ itself needs no attribute), 98 CAN_FLUSH_REMOTE_WRITES
        self.attrs = {}
        for name, code in (("64bit_mem_ops", 122), ("wait_nor", 123), ("flush_remote", 98)):
            self.attrs[name] = v.value if not attr(ctypes.byref(v), code, 0) else None

    def geq(self, stream: int, address: int, value: int) -> int:
        return self.fn(stream, address, value, WAIT_GEQ)


def data(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen, device="cuda")


def expected(n: int, writes: int) -> torch.Tensor:
    chunks = data(n, 0).view(writes, n // writes)
    out = torch.empty_like(chunks)
    out[torch.tensor([(i * 7) % writes for i in range(writes)], device="cuda")] = chunks
    return out.view(-1)


def batch_graphs(x: torch.Tensor, dst: torch.Tensor, writes: int, per_batch: int, rt: Runtime,
                 kernel: CopyKernel | None) -> tuple[list[torch.cuda.CUDAGraph], list]:
    """The W writes in batches of `per_batch` (0: all in one), each one CUDA graph."""
    per_batch = per_batch or writes
    size = x.numel() // writes
    graphs, keep = [], []
    stream = torch.cuda.Stream()
    sides = [torch.cuda.Stream() for _ in range(BRANCHES)]
    for b in range(0, writes, per_batch):
        raw = [(dst.data_ptr() + ((i * 7) % writes) * size, x.data_ptr() + i * size, size)
               for i in range(b, min(b + per_batch, writes))]
        table = None
        if size < ENGINES_MIN and kernel is not None:  # made before the capture
            a = np.array(raw, dtype=np.int64)
            table = kernel.table(a[:, 0], a[:, 1], a[:, 2])
            keep.append(table)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            if table is None:
                main = torch.cuda.current_stream()
                parts = branches(raw, BRANCHES)
                for side, part in zip(sides, parts):
                    side.wait_stream(main)
                    for d, s, m in part:
                        assert not rt.memcpy_async(d, s, m, rt.D2D, side.cuda_stream)
                for side in sides[:len(parts)]:
                    main.wait_stream(side)
            else:
                kernel.launch(table)
        graphs.append(g)
    torch.cuda.synchronize()
    return graphs, keep


def target(q_out, q_in, path: str, rows: list[tuple[int, int]], steps: int,
           rounds: int, lag_us: tuple[float, float]) -> None:
    torch.cuda.set_device(0)
    fd = os.open(path, os.O_RDWR)
    page = mmap.mmap(fd, mmap.PAGESIZE)
    os.close(fd)
    rt, writes_drv = Runtime.load(), StreamWrites.load()
    assert rt is not None and writes_drv is not None
    base = ctypes.addressof(ctypes.c_char.from_buffer(page))
    dev = rt.map_host(base, mmap.PAGESIZE)
    tstream = torch.cuda.Stream()
    k = 0
    for writes, mib in rows:
        n = writes * (mib << 20)
        x = torch.zeros(n, dtype=torch.uint8, device="cuda")
        want = expected(n, writes)
        torch.cuda.synchronize()
        q_out.put(x)
        for _ in range(rounds):
            for mode in MODES:
                x.zero_()
                torch.cuda.synchronize()
                q_out.put("zeroed")
                lat = []
                for _ in range(steps + 3):
                    k += 1
                    burn(lag_us[1])  # the target's host work from DONE seen to READY sent
                    t0 = time.perf_counter()
                    if mode == "gpu2":
                        assert not writes_drv.write64(tstream.cuda_stream, dev + READY, k)
                    else:
                        put(page, READY, k)
                    spin_geq(page, SEEN, k)
                    lat.append(time.perf_counter() - t0)
                    spin_geq(page, DONE, k)
                q_out.put((mode, statistics.median(lat[3:]), bool(torch.equal(x, want)), k))
            assert q_in.get(timeout=300) == "raw-done"
        del x
        q_in.get(timeout=300)  # the source let go of x
    tstream.synchronize()
    rt.unmap_host(base)


def source(q_in, q_out, path: str, rows: list[tuple[int, int]], steps: int,
           rounds: int, per_batch: int, lag_us: tuple[float, float], results) -> None:
    torch.cuda.set_device(0)
    rt, writes_drv, waits = Runtime.load(), StreamWrites.load(), Waits()
    assert rt is not None and writes_drv is not None
    kernel = CopyKernel.load(torch.device("cuda", 0))
    fd = os.open(path, os.O_RDWR)
    page = mmap.mmap(fd, mmap.PAGESIZE)
    os.close(fd)
    base = ctypes.addressof(ctypes.c_char.from_buffer(page))
    dev = rt.map_host(base, mmap.PAGESIZE)
    stream = torch.cuda.Stream()
    s = stream.cuda_stream
    landed = torch.cuda.Event()
    copy_streams = [torch.cuda.Stream() for _ in range(STREAMS)]
    sides = [c.cuda_stream for c in copy_streams]
    events = [torch.cuda.Event() for _ in range(1 + STREAMS)]
    for e in events:  # a torch event makes its CUDA event when first recorded
        e.record(stream)
    ready, joins = events[0].cuda_event, [e.cuda_event for e in events[1:]]
    out = {}
    results["attrs"] = waits.attrs
    k = 0
    for writes, mib in rows:
        n = writes * (mib << 20)
        x = data(n, 0)
        dst = q_in.get(timeout=300)
        graphs, keep = batch_graphs(x, dst, writes, per_batch, rt, kernel)
        execs = [g.raw_cuda_graph_exec() for g in graphs]
        row = {"raw": [], "lat": {m: [] for m in MODES}, "exact": [], **{m: [] for m in MODES}}
        for _ in range(rounds):
            for mode in MODES:
                assert q_in.get(timeout=300) == "zeroed"
                times, t_prev = [], time.perf_counter()
                for step in range(steps + 3):
                    k += 1
                    if mode == "host":
                        spin_geq(page, READY, k)
                        put(page, SEEN, k)
                        burn(lag_us[0])  # the host's work between READY and the post
                    else:
                        burn(lag_us[0])  # the same work, at the step's start
                        assert not waits.geq(s, dev + READY, k)
                        assert not writes_drv.write64(s, dev + SEEN, k)
                    bad = rt.event_record(ready, s)
                    for i, e in enumerate(execs):  # batches across the copy streams in turn
                        side = sides[i % STREAMS]
                        if i < STREAMS:
                            bad = bad or rt.wait_event(side, ready, 0)
                        bad = bad or rt.graph_launch(e, side)
                    for side, ev in zip(sides, joins):
                        bad = bad or rt.event_record(ev, side) or rt.wait_event(s, ev, 0)
                    assert not bad, f"a CUDA runtime call failed ({bad})"
                    assert not writes_drv.write64(s, dev + DONE, k)
                    landed.record(stream)
                    while not landed.query():
                        pass
                    t = time.perf_counter()
                    if step >= 3:
                        times.append(t - t_prev)
                    t_prev = t
                row[mode].append(statistics.median(times))
                m, lat, exact, _ = q_in.get(timeout=300)
                row["lat"][m].append(lat)
                row["exact"].append(exact)
            raw = []
            for step in range(steps + 3):  # the executor bench's baseline
                t0 = time.perf_counter()
                with torch.cuda.stream(stream):
                    dst.copy_(x)
                stream.synchronize()
                if step >= 3:
                    raw.append(time.perf_counter() - t0)
            row["raw"].append(statistics.median(raw))
            q_out.put("raw-done")
        results[f"{writes}x{mib}"] = row  # each row kept as it is measured
        del graphs, keep, execs, dst
        torch.cuda.synchronize()
        q_out.put("released")
    # the watchdog's release: a wait nobody satisfies, released by this host storing READY
    k += 1
    assert not waits.geq(s, dev + READY, k + 1_000_000)
    landed.record(stream)
    time.sleep(0.02)
    stuck = not landed.query()
    t0 = time.perf_counter()
    put(page, READY, k + 1_000_000)
    while not landed.query():
        pass
    out["release"] = (stuck, time.perf_counter() - t0)
    rt.unmap_host(base)
    results.update(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64x4,1024x1")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-batch", type=int, default=8,
                    help="writes a graph (0: a step's writes in one graph, as the executor "
                    "fuses a stage's batches to one peer)")
    ap.add_argument("--source-lag-us", type=float, default=0.0,
                    help="host work the source does a step besides posting (busy time): "
                    "between READY seen and the post in `host`, before the post in `gpu`")
    ap.add_argument("--target-lag-us", type=float, default=0.0,
                    help="host work of the target between DONE seen and the next READY")
    a = ap.parse_args()
    rows = [tuple(int(v) for v in r.split("x")) for r in a.rows.split(",")]
    path = f"/dev/shm/rplan-wait-probe-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(bytes(mmap.PAGESIZE))
    ctx = mp.get_context("spawn")
    to_src, to_tgt = ctx.Queue(), ctx.Queue()
    with ctx.Manager() as mgr:
        results = mgr.dict()
        lag = (a.source_lag_us, a.target_lag_us)
        procs = [ctx.Process(target=target, args=(to_src, to_tgt, path, rows, a.steps,
                                                  a.rounds, lag)),
                 ctx.Process(target=source, args=(to_src, to_tgt, path, rows, a.steps,
                                                  a.rounds, a.per_batch, lag, results))]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=900)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            os.unlink(path)
        res = dict(results)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    rows = [r for r in rows if f"{r[0]}x{r[1]}" in res]  # those measured before a failure
    print(f"device attributes (stream memory ops): {res.get('attrs')}")
    print(f"{a.steps} steps a row, medians, {a.per_batch or 'all'} writes a graph, host work "
          f"a step: source {a.source_lag_us:g} us, target {a.target_lag_us:g} us; ratio = raw "
          "copy / step (the executor bench's)\n")
    print("| writes | round | raw us | " + " | ".join(
        f"{m} step us | ratio | READY -> SEEN us" for m in MODES) + " | bit-exact |")
    print("| --- | ---: | ---: | " + " | ".join("---: | ---: | ---:" for _ in MODES) + " | --- |")
    for writes, mib in rows:
        r = res[f"{writes}x{mib}"]
        for i in range(a.rounds):
            raw = r["raw"][i]
            cells = " | ".join(f"{r[m][i] * 1e6:.0f} | {raw / r[m][i]:.2f} | "
                               f"{r['lat'][m][i] * 1e6:.1f}" for m in MODES)
            print(f"| {writes} x {mib} MiB | {i + 1} | {raw * 1e6:.0f} | {cells} | "
                  f"{'yes' if all(r['exact']) else '**no**'} |")
    if "release" in res:
        stuck, took = res["release"]
        print(f"\nan unsatisfied wait: still parked after 20 ms: {stuck}; released by the host "
              f"storing the counter, the stream done {took * 1e6:.0f} us later")
    if failed:
        raise SystemExit(f"a probe process failed: exit codes {failed}")


if __name__ == "__main__":
    main()
