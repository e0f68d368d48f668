"""A batch as `cuda_ipc` prepares it once and posts every step (`Posted`), and the raw CUDA
handles of its fast post through the runtime (`FastPost`)."""

from __future__ import annotations

import torch

from .base import WriteBatch
from .torch_copy import Op


def branches(raw: list[tuple[int, int, int]], k: int) -> list[list[tuple[int, int, int]]]:
    """`raw` split into at most `k` lists of near-equal bytes (largest copies first, each to
    the lightest list; copies of one list run one after another, lists side by side)."""
    parts: list[list[tuple[int, int, int]]] = [[] for _ in range(max(1, min(k, len(raw))))]
    load = [0] * len(parts)
    for i in sorted(range(len(raw)), key=lambda i: (-raw[i][2], i)):
        j = load.index(min(load))
        parts[j].append(raw[i])
        load[j] += raw[i][2]
    return [p for p in parts if p]


class FastPost:
    """A batch's raw handles for posting through the runtime (no torch stream objects per
    step): events `ready` (the caller's queued work), one per side branch, and `done`."""

    __slots__ = ("events", "ready", "sides", "done", "stream", "side_streams", "graph_exec")

    def __init__(self, stream: torch.cuda.Stream, sides: list[torch.cuda.Stream],
                 graph_exec: int) -> None:
        self.events = [torch.cuda.Event() for _ in range(2 + len(sides))]
        for e in self.events:  # a torch event makes its CUDA event when first recorded
            e.record(stream)
        raw = [e.cuda_event for e in self.events]
        self.ready, self.done, self.sides = raw[0], raw[1], raw[2:]
        self.stream, self.side_streams = stream.cuda_stream, [s.cuda_stream for s in sides]
        self.graph_exec = graph_exec


class Posted:
    """A batch as `cuda_ipc` prepared it: its ops or raw triples, its landed event, its
    CUDA graph or copy-kernel table, its posting order and its raw handles (`FastPost`)."""

    __slots__ = ("batch", "ops", "raw", "stream", "event", "posted", "graph", "order", "sides",
                 "fast", "fast_posted", "table", "batched")

    def __init__(self, batch: WriteBatch, ops: list[Op] | None, stream: torch.cuda.Stream,
                 raw: list[tuple[int, int, int]] | None = None) -> None:
        self.batch, self.ops, self.raw, self.stream = batch, ops, raw, stream
        self.event, self.posted = torch.cuda.Event(), False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.order: list[tuple[int, int, int, int]] = []  # (dst, src, n, raw stream): posts
        self.sides: list[torch.cuda.Stream] = []  # the streams beside `stream` it uses
        self.fast: FastPost | None = None
        self.fast_posted = False
        self.table: torch.Tensor | None = None  # the copy kernel's pieces (its graph reads it)
        self.batched: list[tuple] | None = None  # its `cuMemcpyBatchAsync` arrays (`BatchCopies`)
