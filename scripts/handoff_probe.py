"""What one step's hand-offs cost on this host, piece by piece (a tool: the figures behind
BENCHMARKS.md's "where a step goes" notes on one GPU; needs a GPU).

    python scripts/handoff_probe.py [--reps 2000]

1. Host time per call (median of batches) of what a `cuda_ipc` step calls on its path:
   the runtime calls of a post (`cudaGetDevice`, `Runtime.on`, the current raw stream, event
   record / wait / query, graph launches of the bench's batches), a stream write, a
   signal's MAC and its check (`signals.encode`, `Inbox.add`), a shared-memory notify and
   poll.
2. One signal's round trip between two processes through `ShmMailbox` (sealed, checked
   and answered as the executor does), the spinning side noticing it at once.
3. After a batch of copies lands on the GPU: when the host sees its event complete, and when
   it sees a value the GPU wrote behind it (a stream write after an event wait on another
   stream, as `ipc_signals.py` queues DONE, and one on the copies' own stream).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from executor import signals  # noqa: E402
from executor.auth import keys_from  # noqa: E402
from executor.gpu.copy_kernel import CopyKernel, piece_table  # noqa: E402
from executor.gpu.cuda_runtime import Runtime, StreamWrites, current_raw_stream  # noqa: E402
from executor.transports.ipc_posted import branches  # noqa: E402
from executor.transports.shm_mailbox import ShmMailbox  # noqa: E402

SECRET = "probe-" + "0" * 32
TAG = signals.fingerprint_tag("probe")


def per_call(fn, reps: int, batches: int = 7, between=None) -> float:
    """Median over `batches` of the mean host seconds of one `fn()` (`between()`, untimed,
    before each call where given)."""
    out = []
    for _ in range(batches):
        total = 0.0
        for _ in range(reps):
            if between is not None:
                between()
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
        out.append(total / reps)
    return statistics.median(out)


def engine_graph(rt: Runtime, raw: list[tuple[int, int, int]], k: int) -> torch.cuda.CUDAGraph:
    graph, sides = torch.cuda.CUDAGraph(), [torch.cuda.Stream() for _ in range(k)]
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        for side, part in zip(sides, branches(raw, k)):
            side.wait_stream(main)
            for d, s, n in part:
                assert not rt.memcpy_async(d, s, n, Runtime.D2D, side.cuda_stream)
        for side in sides:
            main.wait_stream(side)
    return graph


def batch(writes: int, mib: float) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    size = int(mib * 2**20)
    src = torch.randint(0, 256, (writes * size,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    raw = [(dst.data_ptr() + ((i * 7) % writes) * size, src.data_ptr() + i * size, size)
           for i in range(writes)]
    return src, dst, raw


def host_costs(reps: int) -> None:
    rt = Runtime.load()
    assert rt is not None
    raw_stream = current_raw_stream()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    event = torch.cuda.Event()
    event.record(s1)  # created here
    ev_h, st1, st2 = event.cuda_event, s1.cuda_stream, s2.cuda_stream
    torch.cuda.synchronize()

    def on() -> None:
        with rt.on(0):
            pass

    rows = [("a Python call (no-op)", lambda: None),
            ("cudaGetDevice (Runtime.device)", rt.device),
            ("`with Runtime.on(dev)` (same device)", on),
            ("current raw stream (torch._C)", lambda: raw_stream(0)),
            ("cudaEventRecord", lambda: rt.event_record(ev_h, st1)),
            ("cudaStreamWaitEvent", lambda: rt.wait_event(st2, ev_h, 0)),
            ("cudaEventQuery (complete)", lambda: rt.event_query(ev_h))]
    for name, fn in rows:
        print(f"| {name} | {per_call(fn, reps) * 1e6:.2f} |", flush=True)
    torch.cuda.synchronize()

    for writes, mib, ks in ((64, 4, (4, 8, 16)), (1024, 1, ())):
        src, dst, raw = batch(writes, mib)
        graphs = [(f"cudaGraphLaunch, {writes} x {mib:g} MiB engine copies, {k} branches",
                   engine_graph(rt, raw, k)) for k in ks]
        kernel = CopyKernel.load(torch.device("cuda", 0))
        if kernel is not None:
            d, s, n = (np.array(c, dtype=np.int64) for c in zip(*raw))
            table = torch.from_numpy(piece_table(d, s, n)).cuda()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                kernel.launch(table)
            graphs.append((f"cudaGraphLaunch, {writes} x {mib:g} MiB copy kernel", g))
        for name, g in graphs:
            ex = g.raw_cuda_graph_exec()
            g.replay()
            torch.cuda.synchronize()
            t = per_call(lambda ex=ex: rt.graph_launch(ex, st1), 20, 5, between=s1.synchronize)
            print(f"| {name} | {t * 1e6:.2f} |", flush=True)
        del graphs, src, dst
        torch.cuda.synchronize()

    writes = StreamWrites.load()
    page, host = host_page()
    dev_ptr = rt.map_host(host, mmap.PAGESIZE)
    if writes is not None:
        t = per_call(lambda: writes.write64(st2, dev_ptr, 1), reps)
        print(f"| cuStreamWriteValue64 | {t * 1e6:.2f} |", flush=True)
    torch.cuda.synchronize()
    rt.unmap_host(host)



def python_costs(reps: int) -> None:
    keys = keys_from(SECRET)
    seq = iter(range(1, 1 << 40))
    inbox = signals.Inbox(TAG, incarnation=7, rank=1, keys=keys)
    inbox.set_incarnation(0, 5)
    t = per_call(lambda: signals.encode(keys, TAG, 5, 7, 1, 0, 2, 0, next(seq)), reps)
    print(f"| signals.encode (sealed) | {t * 1e6:.2f} |")
    msgs = [[("shm:0", signals.encode(keys, TAG, 5, 7, 1, 0, 2, 0, next(seq)))]
            for _ in range(7 * reps)]
    it = iter(msgs)
    key = [signals.expected(1, 0, 2, 0)]
    print(f"| Inbox.add (checked) + take | "
          f"{per_call(lambda: (inbox.add(next(it), 1), inbox.take(key)), reps) * 1e6:.2f} |")
    a, b = ShmMailbox(0, "probe"), ShmMailbox(1, "probe")
    a.import_peer(1, b.export())
    b.import_peer(0, a.export())
    m = msgs[0][0][1]
    print(f"| ShmMailbox.poll (nothing) | {per_call(b.poll, reps) * 1e6:.2f} |")
    t = per_call(lambda: a.notify(1, m), 500, 7, between=b.poll)
    print(f"| ShmMailbox.notify | {t * 1e6:.2f} |")
    print(f"| ShmMailbox.poll (one message) | "
          f"{per_call(b.poll, 500, 7, between=lambda: a.notify(1, m)) * 1e6:.2f} |", flush=True)
    a.close()
    b.close()


def host_page() -> tuple[mmap.mmap, int]:
    """An anonymous host page (page-aligned: pinnable) and its address."""
    page = mmap.mmap(-1, mmap.PAGESIZE)
    first = ctypes.c_char.from_buffer(page)
    address = ctypes.addressof(first)
    del first
    return page, address


def ping_pong(rounds: int) -> None:
    """This process (rank 0) and a child (rank 1): `rounds` round trips of sealed signals."""
    keys = keys_from(SECRET)
    me = ShmMailbox(0, "pp")
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--pong", me.token,
                              str(rounds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    token = child.stdout.readline().strip()  # type: ignore[union-attr]
    me.import_peer(1, {"token": token, "host": os.uname().nodename})
    inbox = signals.Inbox(TAG, incarnation=5, rank=0, keys=keys)
    inbox.set_incarnation(1, 7)
    child.stdin.write("go\n")  # type: ignore[union-attr]
    child.stdin.flush()  # type: ignore[union-attr]
    times = []
    for i in range(rounds):
        t0 = time.perf_counter()
        me.notify(1, signals.encode(keys, TAG, 5, 7, i, 0, 2, 0, i + 1))
        want = [(i, 0, 0, 1)]
        while True:
            inbox.add(me.poll(), i)
            if not inbox.take(want):
                break
        times.append(time.perf_counter() - t0)
    child.wait()
    me.close()
    t = sorted(times[rounds // 10:])
    print(f"| a sealed signal there and back between 2 processes (shm, both spinning) | "
          f"median {statistics.median(t) * 1e6:.1f} us, p90 {t[int(len(t) * 0.9)] * 1e6:.1f} |",
          flush=True)


def pong(token: str, rounds: int) -> None:
    keys = keys_from(SECRET)
    me = ShmMailbox(1, "pp")
    print(me.token, flush=True)
    me.import_peer(0, {"token": token, "host": os.uname().nodename})
    inbox = signals.Inbox(TAG, incarnation=7, rank=1, keys=keys)
    inbox.set_incarnation(0, 5)
    sys.stdin.readline()
    for i in range(rounds):
        want = [(i, 0, 2, 0)]
        while True:
            inbox.add(me.poll(), i)
            if not inbox.take(want):
                break
        me.notify(0, signals.encode(keys, TAG, 7, 5, i, 0, 0, 1, i + 1))
    me.close()


def landed(reps: int) -> None:
    """From a graph launch of 64 x 4 MiB engine copies (16 branches): when the host sees the
    copies' event complete, a stream write behind them on another stream (after an event
    wait) and one on their own stream; medians of `reps` (us after the launch returned)."""
    rt = Runtime.load()
    writes = StreamWrites.load()
    assert rt is not None and writes is not None
    src, dst, raw = batch(64, 4)
    g = engine_graph(rt, raw, 16)
    ex = g.raw_cuda_graph_exec()
    s1, sig = torch.cuda.Stream(), torch.cuda.Stream()
    e = torch.cuda.Event()
    page, host = host_page()
    dev = rt.map_host(host, mmap.PAGESIZE)
    word_a = ctypes.c_uint64.from_address(host)
    word_b = ctypes.c_uint64.from_address(host + 64)
    res: dict[str, list[float]] = {"event complete": [], "stream write, signal stream": [],
                                   "stream write, own stream": []}
    for i in range(1, reps + 1):
        torch.cuda.synchronize()
        rt.graph_launch(ex, s1.cuda_stream)
        e.record(s1)
        writes.write64(s1.cuda_stream, dev + 64, i)
        rt.wait_event(sig.cuda_stream, e.cuda_event, 0)
        writes.write64(sig.cuda_stream, dev, i)
        t0 = time.perf_counter()
        seen: dict[str, float] = {}
        while len(seen) < 3:
            now = time.perf_counter()
            if "event complete" not in seen and rt.event_query(e.cuda_event) == 0:
                seen["event complete"] = now
            if "stream write, signal stream" not in seen and word_a.value == i:
                seen["stream write, signal stream"] = now
            if "stream write, own stream" not in seen and word_b.value == i:
                seen["stream write, own stream"] = now
        for k, v in seen.items():
            res[k].append((v - t0) * 1e6)
    torch.cuda.synchronize()
    rt.unmap_host(host)
    for k, v in res.items():
        print(f"| 64 x 4 MiB copies: host sees {k} | {statistics.median(v[2:]):.1f} us after "
              "the posts |", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--pong":
        pong(sys.argv[2], int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    torch.cuda.set_device(0)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, Python "
          f"{sys.version.split()[0]}\n| what | host us a call |\n| --- | ---: |", flush=True)
    host_costs(a.reps)
    python_costs(a.reps)
    ping_pong(2000)
    landed(30)


if __name__ == "__main__":
    main()
