"""Pass 2 (`layouts`): model spec + one side's config -> every rank's physical tensors."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.spec import ModelSpec
from schemas.config import ConfigError, SourceConfig, TargetConfig

__all__ = ["Layout", "PhysicalTensor", "Piece", "RankLayout", "build_layout"]


def build_layout(spec: ModelSpec, side: SourceConfig | TargetConfig,
                 hf: dict[str, Any] | None = None) -> Layout:
    """The layout of one side: dispatches on `framework` / `engine`. A vLLM layout traced
    from the engine's loader (`planner/layouts/traced.py`) needs the model's HF config."""
    if isinstance(side, TargetConfig) and side.dtype == "fp8_block128":
        from planner.fp8 import quantize_layout

        return quantize_layout(build_layout(spec, replace(side, dtype="bfloat16"), hf), spec)
    if isinstance(side, SourceConfig):
        if side.framework == "megatron":
            from planner.layouts import megatron as mod
        else:
            from planner.layouts import fsdp2 as mod
    elif side.engine == "vllm":
        from planner.layouts import traced

        if traced.uses_trace(spec, side):
            if hf is None:
                raise ConfigError(f"target.layout: {side.layout} (model_type "
                                  f"{spec.dims.model_type!r}) traces vLLM's loader, which "
                                  "needs the model's HF config; compile from a config file")
            return traced.layout(spec, side, hf)
        from planner.layouts import vllm as mod
    else:
        from planner.layouts import sglang as mod
    return mod.layout(spec, side)
