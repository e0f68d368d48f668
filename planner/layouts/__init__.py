"""Pass 2 (`layouts`): model spec + one side's config -> every rank's physical tensors."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.spec import ModelSpec
from schemas.config import ConfigError, SourceConfig, TargetConfig

if TYPE_CHECKING:
    from planner.layouts.trace_ahead import Pending

__all__ = ["Layout", "PhysicalTensor", "Piece", "RankLayout", "build_layout", "start_layout"]


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


def start_layout(spec: ModelSpec, side: TargetConfig, hf: dict[str, Any] | None = None
                 ) -> Pending:
    """`build_layout(spec, side, hf)`, begun: a traced vLLM target that is not cached starts
    tracing now in a forked process (`planner/layouts/trace_ahead.py`); any other layout is
    built when `result()` is called. Use it as a context manager (leaving it stops a tracer)."""
    from planner.layouts import trace_ahead, traced

    bf16 = replace(side, dtype="bfloat16") if side.dtype == "fp8_block128" else side
    if hf is None or side.engine != "vllm" or not traced.uses_trace(spec, bf16):
        return trace_ahead.Pending(lambda: build_layout(spec, side, hf))
    if bf16 is side:
        return trace_ahead.begin(spec, side, hf)
    from planner.fp8 import quantize_layout

    return trace_ahead.begin(spec, bf16, hf, then=lambda layout: quantize_layout(layout, spec))
