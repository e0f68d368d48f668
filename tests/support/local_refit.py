"""A plan run in this process (`executor.run_all_local`) from full logical tensors: every
plan rank's tensors (sources their shards, targets zeros), the targets' after the run, and
which of them differ, bit for bit, from what the target layout says they hold."""

from __future__ import annotations

import torch

import executor
from harness.weights import materialize
from planner.layouts.base import Layout


def world_tensors(src: Layout, dst: Layout, full: dict[str, torch.Tensor],
                  target_full: dict[str, torch.Tensor] | None = None
                  ) -> dict[int, dict[str, torch.Tensor]]:
    """Every plan rank's tensors: the source ranks' shards of `full` as `src` lays them out,
    then (plan rank `src.world + r`) target rank r's tensors as `dst` lays them out, zeros.
    `target_full`: the logical tensors the targets are laid out from, where they differ from
    `full` (block-FP8 targets: with their scales)."""
    tensors = materialize(src, full)
    shapes = full if target_full is None else target_full
    for r, t in materialize(dst, {k: torch.zeros_like(v) for k, v in shapes.items()}).items():
        tensors[src.world + r] = t
    return tensors


def refit_locally(path: str, src: Layout, dst: Layout, full: dict[str, torch.Tensor],
                  target_full: dict[str, torch.Tensor] | None = None
                  ) -> dict[int, dict[str, torch.Tensor]]:
    """Plan `path` run once over `world_tensors(src, dst, full, target_full)`: each target
    rank's tensors after it, by target rank."""
    tensors = world_tensors(src, dst, full, target_full)
    executor.run_all_local(path, tensors)
    return {r: tensors[src.world + r] for r in range(dst.world)}


def refit_differs(path: str, src: Layout, dst: Layout, full: dict[str, torch.Tensor],
                  target_full: dict[str, torch.Tensor] | None = None) -> list[tuple[int, str]]:
    """`refit_locally`, then the (target rank, tensor name) of every target tensor whose bytes
    differ from `target_full` (default `full`) as `dst` lays it out; empty when the refit
    is bit-exact."""
    got = refit_locally(path, src, dst, full, target_full)
    want = materialize(dst, full if target_full is None else target_full)
    return [(r, name) for r, ts in want.items() for name, w in ts.items()
            if not torch.equal(got[r][name].view(torch.uint8), w.view(torch.uint8))]
