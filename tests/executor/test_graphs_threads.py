"""CUDA graph captures from several threads of one process (`transports/graphs.py`): the
executors of a chunked shadow's chunks, or of `bench/zero_pause.py`'s ranks, prepare on
threads of their own. Each capture must succeed (one at a time, never beside another
thread's whole-device synchronize) and replay what eager ops write (`pytest -m gpu`; on
one H200 the unguarded captures failed: "already recording to mempool_id", "operation not
permitted when stream is capturing")."""

from __future__ import annotations

import threading

import pytest
import torch

from executor.gpu.graphs import Replay, as_graph, device_sync


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captures_on_many_threads_beside_device_syncs_all_capture_and_replay_right():
    dev = torch.device("cuda", 0)
    n = 8
    src = [torch.randn(1 << 20, device=dev) for _ in range(n)]
    dst = [torch.zeros(1 << 20, device=dev) for _ in range(n)]
    graphs: list[list] = [[] for _ in range(n)]
    stop = threading.Event()
    go = threading.Barrier(n + 1)

    def capture(i: int) -> None:
        def op() -> None:
            dst[i].copy_(src[i] * 2 + i)  # a temporary: the graph's pool
        go.wait()
        for _ in range(5):
            graphs[i].append(as_graph([op], dev, f"thread {i}"))

    def syncs() -> None:
        go.wait()
        while not stop.is_set():
            device_sync(dev)

    threads = [threading.Thread(target=capture, args=(i,)) for i in range(n)]
    syncer = threading.Thread(target=syncs)
    for th in [*threads, syncer]:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    syncer.join()
    for i in range(n):
        assert all(len(g) == 1 and isinstance(g[0], Replay) for g in graphs[i]), \
            f"thread {i}: a capture failed (ops left eager)"
        assert torch.count_nonzero(dst[i]) == 0, "capture must not run the ops"
        graphs[i][-1][0]()
    torch.cuda.synchronize(dev)
    for i in range(n):
        assert torch.equal(dst[i], src[i] * 2 + i)
