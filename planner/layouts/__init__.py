"""Pass 2 (`layouts`): model spec + one side's config -> every rank's physical tensors."""

from __future__ import annotations

from dataclasses import replace

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
    if isinstance(side, TargetConfig) and side.dtype == "fp8_block128":
        from planner.fp8 import quantize_layout

        return quantize_layout(mod.layout(spec, replace(side, dtype="bfloat16")), spec)
    return mod.layout(spec, side)
