"""A list of prepared GPU ops as one CUDA graph: one launch per step instead of one per op.

Packs, QUANTs and unpacks of a stage (and `local`'s copies on a GPU) are kernels with fixed
arguments (views and index tensors built at connect), so they are captured once and
replayed. Capture records kernels without running them: nothing is written at connect.
Ops that cannot be captured (a failing capture, or any op on the CPU) stay as they are,
with a warning naming the rank. The replay keeps the ops alive: the graph reads their
index tensors and views in place, and freed memory would be handed to other tensors.

Temporaries (an `index_select` of a group of boxes, a quantizer's scratch) live in the
graph's memory pool for good. Every graph of a device shares one pool, so a rank holds the
largest graph's temporaries, not the sum over its stages: safe because no graph's
temporaries outlive it (results land in registered regions) and the executor replays its
graphs one at a time on the caller's stream.
"""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

Op = Callable[[], None]
_POOLS: dict[int, object] = {}
"""Device index -> the memory pool its captured graphs share."""
_LOCK = threading.RLock()
"""Held for a capture and for `device_sync`: executors of one process on threads of their
own (a chunked shadow's chunks, `bench/zero_pause.py`'s ranks) capture one at a time (two
captures into one pool fail: "already recording to mempool_id") and never synchronize the
whole device while another thread captures (CUDA refuses it: "operation not permitted when
stream is capturing", seen on one H200)."""


def device_sync(device: torch.device) -> None:
    """`torch.cuda.synchronize(device)`, never while this process captures a graph."""
    with _LOCK:
        torch.cuda.synchronize(device)


_ORDER: list[Replay] | None = None
"""While `recording`: every replay, in the order it ran."""


class Replay:
    """One captured graph, replayed on the current stream; holds what the graph reads."""

    __slots__ = ("graph", "ops")

    def __init__(self, graph: torch.cuda.CUDAGraph, ops: list[Op]) -> None:
        self.graph, self.ops = graph, ops

    def __call__(self) -> None:
        self.graph.replay()
        if _ORDER is not None:
            _ORDER.append(self)


@contextmanager
def recording() -> Iterator[list[Replay]]:
    """The replays that run inside the block, in order (one thread's: `run_all_local`)."""
    global _ORDER
    _ORDER = order = []
    try:
        yield order
    finally:
        _ORDER = None


@contextmanager
def capturing(device: torch.device, graph: torch.cuda.CUDAGraph,
              pool: object = None) -> Iterator[None]:
    """Capture into `graph` on `device`, robust to the rest of the process: in
    `thread_local` mode (another thread's CUDA calls, an engine's or our publisher's, do
    not void it) and with Python's cyclic GC off (a collection freeing an old graph, an
    executor closed earlier, destroys it mid-capture; seen on one H100 as every later
    capture failing). On failure the device's shared pool is dropped: torch leaves a failed
    capture's pool recording, and every later capture into it fails."""
    _LOCK.acquire()
    enabled = gc.isenabled()
    gc.disable()  # torch.cuda.graph still collects once, before the capture begins
    try:
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool,
                                                         capture_error_mode="thread_local"):
            yield
    except BaseException:
        _POOLS.pop(torch.device(device).index or 0, None)
        raise
    finally:
        if enabled:
            gc.enable()
        _LOCK.release()


def as_graph(ops: list[Op], device: torch.device, what: str) -> list[Op]:
    """`ops` captured as one graph's replay, or `ops` unchanged (CPU, none, or failure)."""
    if device.type != "cuda" or not ops:
        return ops
    graph = torch.cuda.CUDAGraph()
    try:
        index = torch.device(device).index or 0
        if index not in _POOLS:
            _POOLS[index] = torch.cuda.graph_pool_handle()
        with capturing(device, graph, _POOLS[index]):
            for op in ops:
                op()
    except Exception as e:  # noqa: BLE001 - any capture failure: run the ops one by one
        warnings.warn(f"{what}: could not capture {len(ops)} op(s) as a CUDA graph ({e}); "
                      "they run one by one", stacklevel=2)
        device_sync(device)
        return ops
    return [Replay(graph, ops)]
