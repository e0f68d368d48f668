"""The coverage property shared by the target-layout tests (vLLM, SGLang).

Within one replica (one engine), each element of a logical tensor the engine loads must be
held exactly `expected` times, where `expected` is the size of its TP-replication class:

    expected = stages x dp_copies x replication

- `stages`: PP stages that hold the tensor (1 for layer tensors; embed/norm/lm_head: 1, or
  2 for a tied embedding under PP, or every stage for vLLM's Qwen3-MoE);
- `dp_copies`: engine ranks of one stage with the same TP rank (vLLM dp; SGLang dp when
  attention is not DP-split); routed experts have 1 (split over all ranks of the stage);
- `replication`: 1 for TP-split tensors; `tp` for replicated ones (norms, router, bias,
  MLA down projections); `tp / kv_heads` for k/v rows when TP exceeds the KV heads.

MTP tensors are never held. Every piece lies inside its physical tensor and no two pieces
of one physical tensor overlap (`coverage.pieces_fit`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from planner.layouts.base import Layout, PhysicalTensor
from planner.spec import ModelSpec
from tests.support.coverage import coverage

TP_SPLIT = ("q_proj.", "o_proj.", "q_b_proj.", "kv_b_proj.", "gate_proj.", "up_proj.",
            "down_proj.", "embed_tokens.", "lm_head.")


def tensor(layout: Layout, rank: int, name: str) -> PhysicalTensor:
    found = [t for t in layout.ranks[rank].tensors if t.name == name]
    assert found, f"rank {rank} has no {name}"
    return found[0]


def names(layout: Layout, rank: int) -> list[str]:
    return [t.name for t in layout.ranks[rank].tensors]


def check_replicas(layout: Layout, engine_world: int) -> None:
    """Every replica holds the same tensors and pieces as replica 0."""
    assert layout.world == engine_world * layout.replicas
    for rl in layout.ranks:
        assert rl.replica == rl.rank // engine_world
        assert rl.tensors == layout.ranks[rl.rank % engine_world].tensors


def check_coverage(spec: ModelSpec, layout: Layout,
                   expected: Callable[[str], int]) -> None:
    counts = coverage(spec, layout, lambda rl, pt, name: rl.replica)
    for replica in range(layout.replicas):
        for t in spec.tensors:
            got = counts.get((replica, t.name))
            if t.mtp:
                assert got is None, f"{t.name}: MTP tensors are not loaded by the engine"
                continue
            assert got is not None, f"replica {replica}: {t.name} is held by no rank"
            want = expected(t.name)
            assert want >= 1
            assert np.all(got == want), (f"replica {replica} {t.name}: held "
                                         f"{np.unique(got).tolist()} times, want {want}")
