"""CUDA-event timing for the GPU tools under scripts/: the seconds between an event recorded
on the current stream before a piece of work and one after, over repeated runs, the work
posted eagerly or captured once as a CUDA graph and replayed. Needs a GPU."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np
import torch


def event_seconds(run: Callable[[], object], reps: int, sync: bool = False) -> list[float]:
    """Seconds from an event recorded before `run()` to one recorded after it, for each of
    `reps` runs, each waited for before the next. `sync`: the whole device idle before each
    run, so the host's time posting the work counts."""
    out = []
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def captured(fn: Callable[[], object]) -> Callable[[], None]:
    """`fn`'s work captured once as a CUDA graph (its posts run once, into the graph): the
    graph's replay."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def graph_timed(fn: Callable[[], object], reps: int = 30, graph: bool = True) -> float:
    """Median seconds of `fn` between two CUDA events, captured as a graph and replayed (or,
    `graph=False`, posted eagerly), after one untimed run."""
    run = captured(fn) if graph else fn
    run()
    torch.cuda.synchronize()
    return statistics.median(event_seconds(run, reps))


def eager_timed(fn: Callable[[], object], reps: int = 30) -> float:
    """Median seconds between an event before and one after `fn`'s eager posts, the GPU idle
    until the first post (the host's posting time counts), after one untimed run."""
    fn()
    return statistics.median(event_seconds(fn, reps, sync=True))


class Scrambled:
    """A probe's `writes` pieces of `size` bytes each: random bytes in `src`, each piece
    bound for a scrambled slot of `dst` (piece i to slot i * 7 mod writes), with the
    addresses and sizes of each piece's copy and the bytes `dst` holds once all landed."""

    def __init__(self, row: str, dev: torch.device, dst_dev: torch.device | None = None
                 ) -> None:
        """`row`: "WRITESxMIB", e.g. "64x4" or "1024x0.5"; `dst` on `dst_dev` (another GPU,
        written over NVLink) where given, else on `dev`."""
        w, mib = row.split("x")
        self.writes, self.size = writes, size = int(w), int(float(mib) * 2**20)
        self.n = n = writes * size
        self.src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
        self.dst = torch.empty(n, dtype=torch.uint8, device=dst_dev or dev)
        slot = torch.tensor([(i * 7) % writes for i in range(writes)], device=dev)
        self.want = self.src.view(writes, size)[slot.argsort()].reshape(-1).to(self.dst.device)
        self.s = self.src.data_ptr() + np.arange(writes, dtype=np.int64) * size
        self.d = self.dst.data_ptr() + (np.arange(writes, dtype=np.int64) * 7 % writes) * size
        self.sizes = np.full(writes, size, dtype=np.int64)
