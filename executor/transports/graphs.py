"""A list of prepared GPU ops as one CUDA graph: one launch per step instead of one per op.

Packs, QUANTs and unpacks of a stage (and `local`'s copies on a GPU) are kernels with fixed
arguments (views and index tensors built at connect), so they are captured once and
replayed. Capture records kernels without running them: nothing is written at connect.
Ops that cannot be captured (a failing capture, or any op on the CPU) stay as they are,
with a warning naming the rank. The replay keeps the ops alive: the graph reads their
index tensors and views in place, and freed memory would be handed to other tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

Op = Callable[[], None]


class Replay:
    """One captured graph, replayed on the current stream; holds what the graph reads."""

    __slots__ = ("graph", "ops")

    def __init__(self, graph: torch.cuda.CUDAGraph, ops: list[Op]) -> None:
        self.graph, self.ops = graph, ops

    def __call__(self) -> None:
        self.graph.replay()


def as_graph(ops: list[Op], device: torch.device, what: str) -> list[Op]:
    """`ops` captured as one graph's replay, or `ops` unchanged (CPU, none, or failure)."""
    if device.type != "cuda" or not ops:
        return ops
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.device(device), torch.cuda.graph(graph):
            for op in ops:
                op()
    except Exception as e:  # noqa: BLE001 - any capture failure: run the ops one by one
        warnings.warn(f"{what}: could not capture {len(ops)} op(s) as a CUDA graph ({e}); "
                      "they run one by one", stacklevel=2)
        torch.cuda.synchronize(device)
        return ops
    return [Replay(graph, ops)]
