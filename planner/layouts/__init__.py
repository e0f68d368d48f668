"""Pass 2 (`layouts`): model spec + one side's config -> every rank's physical tensors."""

from __future__ import annotations

from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.spec import ModelSpec
from schemas.config import SourceConfig, TargetConfig

__all__ = ["Layout", "PhysicalTensor", "Piece", "RankLayout", "build_layout"]


def build_layout(spec: ModelSpec, side: SourceConfig | TargetConfig) -> Layout:
    """The layout of one side: dispatches on `framework` / `engine`."""
    if isinstance(side, SourceConfig):
        if side.framework == "megatron":
            from planner.layouts import megatron as mod
        else:
            from planner.layouts import fsdp2 as mod
    elif side.engine == "vllm":
        from planner.layouts import vllm as mod
    else:
        from planner.layouts import sglang as mod
    return mod.layout(spec, side)
