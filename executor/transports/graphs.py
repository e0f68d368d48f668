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

import warnings
from collections.abc import Callable

import torch

Op = Callable[[], None]
_POOLS: dict[int, object] = {}
"""Device index -> the memory pool its captured graphs share."""


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
        index = torch.device(device).index or 0
        if index not in _POOLS:
            _POOLS[index] = torch.cuda.graph_pool_handle()
        pool = _POOLS[index]
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool):
            for op in ops:
                op()
    except Exception as e:  # noqa: BLE001 - any capture failure: run the ops one by one
        warnings.warn(f"{what}: could not capture {len(ops)} op(s) as a CUDA graph ({e}); "
                      "they run one by one", stacklevel=2)
        torch.cuda.synchronize(device)
        return ops
    return [Replay(graph, ops)]
