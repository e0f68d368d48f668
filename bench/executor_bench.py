"""Executor overhead: a plan of W writes vs one raw write of the same bytes.

    python bench/executor_bench.py [--writes 64] [--mib 4] [--steps 5] [--record]
                                   [--transport nixl|cuda_ipc] [--device cpu|cuda]
    python bench/executor_bench.py --tiny    # 8 x 64 KiB on CPU, nixl and local, seconds

1. NIXL (or CUDA IPC), 2 processes (rank 0 source, rank 1 target): `executor.run` (READY,
   W writes in batches of 8, DONE) vs one raw write of all the bytes between the same
   registered buffers (one NIXL descriptor; one copy into the IPC-mapped peer tensor), in
   the same processes. Over CUDA IPC a second baseline: the same W writes (same sizes,
   same slots) as raw copies in one CUDA graph, the faster of 1 and 4 branches.
2. `local` transport (`run_all_local`) vs one `torch` copy of the same bytes.
Medians over `--steps` warm steps; `--record` appends the table to BENCHMARKS.md. The
source's step period (run start to run start) is printed beside its run's time.
Diagnostics by environment: `BENCH_PROFILE=1` (cProfile of each rank), `BENCH_TRACE=DIR`
[`BENCH_TRACE_FINE=1`] (`step_trace.py`), `BENCH_STEP_RECORDS=0`, `BENCH_PIN=A,B` (rank r's
main thread on CPU r of the list), `BENCH_GC_FREEZE=1`, `BENCH_MICRO=1` (each rank's context
switches over the steps and its host calls timed in a warm loop of the same process).
"""

from __future__ import annotations

import argparse
import cProfile
import faulthandler
import gc
import io
import json
import os
import platform
import pstats
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import executor  # noqa: E402
from bench import step_trace  # noqa: E402
from harness.launch import free_port, root_env, spawn_ranks  # noqa: E402
from schemas.header import PlanHeader  # noqa: E402
from schemas.plan import (  # noqa: E402
    BATCH_COLUMNS,
    COPY_COLUMNS,
    DONE,
    READY,
    SIGNAL_COLUMNS,
    WRITE_COLUMNS,
    Plan,
    RankPlan,
    Region,
    Table,
    load_rank,
)
from schemas.plan_write import write_plan  # noqa: E402


def make_plan(path: str, writes: int, chunk: int, per_batch: int = 8, compact: bool = True) -> int:
    """Rank 0 "x" -> rank 1 "x": `writes` writes of `chunk` bytes, chunk i to slot
    (i * 7) % writes (a permutation when gcd(7, writes) == 1), `per_batch` per batch; the
    plan file's blobs compact (the default) or plain (`compact=False`)."""
    n = writes * chunk
    x = Region("x", "uint8", (n,), n)
    order = [(i * 7) % writes for i in range(writes)]
    w = Table.build(WRITE_COLUMNS, dst_rank=[1] * writes, src_region=[0] * writes,
                    src_offset=[i * chunk for i in range(writes)], dst_region=[0] * writes,
                    dst_offset=[o * chunk for o in order], nbytes=[chunk] * writes)
    starts = list(range(0, writes, per_batch))
    b = Table.build(BATCH_COLUMNS, stage=[0] * len(starts), nic=[0] * len(starts), start=starts,
                    stop=[min(s + per_batch, writes) for s in starts])
    sig = lambda peer, kind: Table.build(SIGNAL_COLUMNS, stage=[0], peer=[peer], kind=[kind])  # noqa: E731
    empty = lambda schema: Table.empty(schema)  # noqa: E731
    ranks = (RankPlan(0, "source", 0, 0, ("lo",), (x,), w, b, empty(COPY_COLUMNS), sig(1, DONE),
                      sig(1, READY), ((1, ((0, n),)),), 1),
             RankPlan(1, "target", 0, 1, ("lo",), (x,), empty(WRITE_COLUMNS),
                      empty(BATCH_COLUMNS), empty(COPY_COLUMNS), sig(0, READY), sig(0, DONE),
                      (), 1))
    write_plan(path, Plan(PlanHeader(fingerprint=f"bench-{writes}x{chunk}", world=2), ranks),
               compact=compact)
    return n


def raw_nixl(plan: executor.Executor, x: torch.Tensor, steps: int) -> list[float]:
    t, n = plan.transport, x.numel()
    name, addrs, dev = t.peers[1]
    lh = t.agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[x.data_ptr(), n, t.dev]],
                                                             dtype=np.uint64), t.mem)
    rh = t.agent.prep_xfer_dlist(name, np.array([[addrs[0], n, dev]], dtype=np.uint64), t.mem)
    xfer = t.agent.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    raw = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        t.agent.transfer(xfer)
        while t.agent.check_xfer_state(xfer) == "PROC":
            time.sleep(2e-5)
        raw.append(time.perf_counter() - t0)
    xfer.release()
    return raw[1:]


def raw_cuda_ipc(plan: executor.Executor, x: torch.Tensor, steps: int) -> list[float]:
    t, dst = plan.transport, plan.transport.peers[1][0]
    stream = t.streams[0]  # one of the transport's copy streams
    raw = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        if isinstance(dst, torch.Tensor):
            with torch.cuda.stream(stream):
                dst.copy_(x)
        else:  # a peer on another GPU mapped by the transport itself: the same one copy
            err = t.rt.memcpy_async(dst.data_ptr(), x.data_ptr(), x.numel(), t.rt.D2D,
                                    stream.cuda_stream)
            if err:
                raise RuntimeError(f"the raw baseline's cudaMemcpyAsync failed (CUDA error {err})")
        stream.synchronize()
        raw.append(time.perf_counter() - t0)
    return raw[1:]


def raw_cuda_ipc_writes(plan: executor.Executor, x: torch.Tensor, writes: int,
                        steps: int) -> tuple[float, int]:
    """The second baseline: the W writes themselves as raw copies (chunk i to slot
    (i * 7) % W of the peer, `cudaMemcpyAsync` each) captured once in one CUDA graph, on 1
    and on 4 parallel branches (copy engines side by side); each step one replay and a
    sync, timed on the host as the one-copy baseline. The faster of the two shapes:
    (median seconds, branches)."""
    t, dst = plan.transport, plan.transport.peers[1][0]
    n, stream = x.numel(), t.streams[0]
    size = n // writes
    raw = [(dst.data_ptr() + ((i * 7) % writes) * size, x.data_ptr() + i * size, size)
           for i in range(writes)]
    best: tuple[float, int] | None = None
    for k in (1, 4):
        graph, sides = torch.cuda.CUDAGraph(), [torch.cuda.Stream(x.device) for _ in range(k)]
        with torch.cuda.graph(graph, stream=stream):
            for side in sides:
                side.wait_stream(stream)
            for i, (d, s, m) in enumerate(raw):
                err = t.rt.memcpy_async(d, s, m, t.rt.D2D, sides[i % k].cuda_stream)
                if err:
                    raise RuntimeError(f"the W-copies baseline's cudaMemcpyAsync failed "
                                       f"(CUDA error {err})")
            for side in sides:
                stream.wait_stream(side)
        times = []
        with torch.cuda.stream(stream):  # a replay runs on the current stream
            for _ in range(steps + 1):
                t0 = time.perf_counter()
                graph.replay()
                stream.synchronize()
                times.append(time.perf_counter() - t0)
        med = statistics.median(times[1:])
        if best is None or med < best[0]:
            best = (med, k)
        del graph
    assert best is not None
    return best


def worker(path: str, rank: int, port: int, steps: int, transport: str, device: str,
           options: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    if os.environ.get("BENCH_HANG_S"):  # where a hung worker was, printed before it exits
        faulthandler.dump_traceback_later(float(os.environ["BENCH_HANG_S"]), exit=True)
    n = load_rank(path, rank)[1].regions[0].nbytes
    x = _data(n, rank, device)
    plan = executor.load(path, rank, {"x": x}, transport=transport, rendezvous=store,
                         timeout_s=120, transport_options=json.loads(options) or None,
                         no_identity=True,
                         step_records=os.environ.get("BENCH_STEP_RECORDS", "1") != "0")
    pin = os.environ.get("BENCH_PIN")  # "A,B": rank r's main thread on CPU r of the list
    if pin:  # (after load: the executor's threads keep the whole mask; a diagnostic)
        os.sched_setaffinity(threading.get_native_id(), {int(pin.split(",")[rank])})
    if os.environ.get("BENCH_GC_FREEZE"):  # the heap so far out of the collector's passes
        gc.collect()
        gc.freeze()
    prof = cProfile.Profile() if os.environ.get("BENCH_PROFILE") else None
    runs = [executor.run(plan)]  # warm-up
    trace = step_trace.attach(plan) if os.environ.get("BENCH_TRACE") else None
    if prof:
        prof.enable()
    switches = _switches() if os.environ.get("BENCH_MICRO") else None
    starts, runs = [], []
    for _ in range(steps):  # (the source's period: from one run's start to the next's)
        starts.append(time.perf_counter())
        runs.append(executor.run(plan))
    starts.append(time.perf_counter())
    if switches is not None:  # where a step's host time goes, in this very process
        _micro(plan, rank, steps, switches)
    if prof:  # where the host's time goes (`BENCH_PROFILE=1`): each rank prints its top 25
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(f"--- rank {rank} profile of {steps} steps\n{out.getvalue()}", flush=True)
    if trace is not None:  # `BENCH_TRACE=DIR`: each event's time of each step
        step_trace.save(os.environ["BENCH_TRACE"], rank, trace)
    print(f"rank {rank}: signals admitted as sealed ahead "  # (none before they were)
          f"{getattr(plan.inbox, 'ahead_hits', '-')}, sent as sealed ahead "
          f"{getattr(plan.signals, 'sent_ahead', '-')}, refused {plan.inbox.refused}", flush=True)
    if rank == 0 and transport == "cuda_ipc":  # which path the batches took
        print(f"rank 0 ({device}) transport stats: {plan.transport.stats()}", flush=True)
    if rank == 1:  # bit-exact: slot (i * 7) % W of the target holds the source's chunk i
        store.set("exact", b"1" if torch.equal(x, _permuted(n, int(store.get("writes")),
                                                            device)) else b"0")
    if rank == 0:
        store.wait(["exact"])  # before the raw copies overwrite the target
        raw = (raw_nixl if transport == "nixl" else raw_cuda_ipc)(plan, x, steps)
        many, branches = (raw_cuda_ipc_writes(plan, x, int(store.get("writes")), steps)
                          if transport == "cuda_ipc" else (float("nan"), 0))
        times = [r.seconds for r in runs]
        host = statistics.median(r.host_seconds for r in runs)
        period = statistics.median(b - a for a, b in zip(starts, starts[1:]))
        store.set("result", f"{statistics.median(times)} {statistics.median(raw)} "
                            f"{host} {many} {branches} {period}".encode())
    else:  # UCX over TCP or shared memory needs the target to make progress too
        while not store.check(["result"]):
            plan.transport.poll()
            time.sleep(1e-4)
    store.set(f"exit/{rank}", b"1")
    store.wait(["exit/0", "exit/1"], timedelta(seconds=120))
    plan.close()


def _switches() -> list[int]:
    """This thread's (voluntary, involuntary) context switches so far."""
    with open("/proc/thread-self/status") as f:
        return [int(ln.split()[1]) for ln in f if "ctxt_switches" in ln]


def _micro(plan: executor.Executor, rank: int, steps: int, before: list[int]) -> None:
    """`BENCH_MICRO=1`: the main thread's context switches over the steps, the clock source,
    a clock read and one signal sealed, checked and taken in a warm loop of this process
    (what the step path costs when nothing else runs between its calls)."""
    import timeit

    from executor import signals as sig
    after = _switches()
    with open("/sys/devices/system/clocksource/clocksource0/current_clocksource") as f:
        source = f.read().strip()
    sealer, inbox = sig.Sealer(plan.keys, plan.tag), sig.Inbox(plan.tag, 77, rank, plan.keys)
    inbox.set_incarnation(9, 55, "shm:9")
    seq = iter(range(1, 1 << 40))

    def one() -> None:
        inbox.add([("shm:9", sealer.seal(55, 77, 5, 0, 1, 9, next(seq)))], 5)
        inbox.take([(5, 0, 1, 9)])
    n = 20000
    us = {name: timeit.timeit(fn, number=n) / n * 1e6 for name, fn in (
        ("perf_counter", time.perf_counter), ("monotonic", time.monotonic),
        ("seal+add+take", one), ("poll", plan.transport.poll))}
    print(f"rank {rank} micro: clocksource {source}; over {steps} steps ctx switches "
          f"voluntary {after[0] - before[0]}, involuntary {after[1] - before[1]}; warm us "
          + ", ".join(f"{k} {v:.2f}" for k, v in us.items()), flush=True)


def _data(n: int, rank: int, device: str) -> torch.Tensor:
    """Rank `rank`'s bytes, the same in every process (generated where they live: 4 GiB of
    random bytes on a CPU take a minute)."""
    gen = torch.Generator(device=device).manual_seed(rank)
    return torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen, device=device)


def _permuted(n: int, writes: int, device: str) -> torch.Tensor:
    """What the target must hold: the source's chunk i at slot (i * 7) % writes."""
    chunks = _data(n, 0, device).view(writes, n // writes)
    out = torch.empty_like(chunks)
    out[torch.tensor([(i * 7) % writes for i in range(writes)], device=device)] = chunks
    return out.view(-1)


def bench_two_processes(path: str, steps: int, transport: str, device: str, writes: int,
                        options: str) -> tuple[float, float, float, bool, float, int]:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    store.set("writes", str(writes).encode())
    gpus = torch.cuda.device_count() if device != "cpu" else 0
    devices = [device, "cuda:1" if gpus > 1 else device]  # the target on another GPU if any
    done = spawn_ranks(lambda r: [sys.executable, os.path.abspath(__file__), "--worker", path,
                                  str(r), str(port), str(steps), transport, devices[r], options],
                       2,
                       env=root_env(NIXL_LOG_LEVEL="WARN", RDMA_PLAN_SECRET=secrets.token_hex(32)),
                       timeout=300, capture=False)
    for f in done:
        if f.returncode:
            raise SystemExit(f"{transport} worker {f.rank} failed with status {f.returncode}")
    if os.environ.get("BENCH_TRACE"):
        print(step_trace.report(os.environ["BENCH_TRACE"]))
    ex, raw, host, many, branches, period = map(float, store.get("result").decode().split())
    print(f"source: a step's period (run start to run start, median) {period * 1e6:.1f} us, "
          f"its run {ex * 1e6:.1f} us; raw / period {raw / period:.2f}", flush=True)
    return ex, raw, host, store.get("exact") == b"1", many, int(branches)


def bench_local(path: str, n: int, writes: int, steps: int, device: str,
                options: str = "{}") -> tuple[float, float, float, bool]:
    src = _data(n, 0, device)
    dst = torch.zeros(n, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    opts = json.loads(options) or None
    runs = [executor.run_all_local(path, {0: {"x": src}, 1: {"x": dst}}, steps=2,
                                   transport_options=opts) for _ in range(steps)]
    exact = torch.equal(dst, _permuted(n, writes, device))
    raw = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        raw.append(time.perf_counter() - t0)
    return (statistics.median(r.seconds for r in runs), statistics.median(raw[1:]),
            statistics.median(r.host_seconds for r in runs), exact)


def machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if ln.startswith("Model name")), platform.processor())
    return f"{os.cpu_count()} cores (`nproc`), {model}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--writes", type=int, default=64)
    ap.add_argument("--mib", type=float, default=4, help="size of one write (MiB)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--plain-plan", action="store_true",
                    help="write the plan's blobs plain, not compact (to compare both forms' "
                    "replay)")
    ap.add_argument("--transport", default="nixl", choices=["nixl", "cuda_ipc"])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (rank 1 on cuda:1 if any)")
    ap.add_argument("--transport-options", default="{}",
                    help='JSON of the transport\'s options, e.g. \'{"graphs": false}\'')
    ap.add_argument("--local-options", default="{}",
                    help='JSON of the local transport\'s options, e.g. \'{"copy_kernel": false}\'')
    ap.add_argument("--no-local", action="store_true",
                    help="skip the `run_all_local` row (two-process rows only)")
    ap.add_argument("--tiny", action="store_true",
                    help="8 writes of 64 KiB, 2 steps, nixl on CPU (the test suite's mode)")
    a = ap.parse_args()
    if a.tiny:
        a.writes, a.mib, a.steps, a.transport, a.device = 8, 1 / 16, 2, "nixl", "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.rplan")
        n = make_plan(path, a.writes, int(a.mib * 2**20), compact=not a.plain_plan)
        dev = "cuda:0" if a.device == "cuda" else a.device
        ex, raw, host, exact, many, branches = bench_two_processes(
            path, a.steps, a.transport, dev, a.writes, a.transport_options)
        name = f"{a.transport} (2 processes, {a.device})"
        rows = [(name, f"raw {a.transport} write", ex, raw, host, exact)]
        if branches:  # the same W writes as raw copies in one CUDA graph
            rows.append((name, f"{a.writes} raw copies, one graph ({branches} branch"
                               f"{'es' if branches > 1 else ''})", ex, many, host, exact))
        if not a.no_local:
            rows.append((f"local (run_all_local, {a.device})", "torch copy_",
                         *bench_local(path, n, a.writes, a.steps, dev, a.local_options)))
    gb = n / 1e9
    lines = [f"{a.writes} writes x {a.mib:g} MiB = {n / 2**20:g} MiB, median of {a.steps} "
             "warm steps",
             "", "| executor | baseline | executor s | baseline s | executor GB/s | "
             "baseline GB/s | ratio | host s per step | bit-exact |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, base, ex, raw, host, exact in rows:
        lines.append(f"| {name} | {base} | {ex:.4f} | {raw:.4f} | {gb / ex:.2f} | "
                     f"{gb / raw:.2f} | {raw / ex:.2f} | {host:.5f} | "
                     f"{'yes' if exact else '**no**'} |")
    table = "\n".join(lines)
    print(table)
    if not all(row[-1] for row in rows):
        raise SystemExit("a benchmark row was not bit-exact")
    if a.record:
        cmd = "python bench/executor_bench.py " + " ".join(sys.argv[1:])
        with open(os.path.join(ROOT, "BENCHMARKS.md"), "a") as f:
            f.write(f"\n## Executor\n\n`{cmd}` on {machine()}, "
                    f"{time.strftime('%Y-%m-%d', time.gmtime())}.\n\n{table}\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6],
               sys.argv[7], sys.argv[8])
    else:
        main()
