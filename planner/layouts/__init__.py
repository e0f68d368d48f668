"""Pass 2 (`layouts`): model spec + one side's config -> every rank's physical tensors."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.spec import ModelSpec
from schemas.config import SourceConfig, TargetConfig

if TYPE_CHECKING:
    from planner.layouts.trace_ahead import Pending

__all__ = ["Layout", "PhysicalTensor", "Piece", "RankLayout", "build_layout", "start_layout"]


def build_layout(spec: ModelSpec, side: SourceConfig | TargetConfig,
                 hf: dict[str, Any] | None = None) -> Layout:
    """The layout of one side, from its framework's or engine's `layout`
    (`planner/frameworks.py`). A vLLM layout traced from the engine's loader
    (`planner/layouts/traced.py`) needs the model's HF config `hf`."""
    if isinstance(side, TargetConfig) and side.dtype == "fp8_block128":
        from planner.fp8 import quantize_layout

        return quantize_layout(build_layout(spec, replace(side, dtype="bfloat16"), hf), spec)
    from planner import frameworks

    return frameworks.of(side).layout(spec, side, hf)


def start_layout(spec: ModelSpec, side: TargetConfig, hf: dict[str, Any] | None = None
                 ) -> Pending:
    """`build_layout(spec, side, hf)`, begun: a traced vLLM target that is not cached starts
    tracing now in a forked process (`planner/layouts/trace_ahead.py`); any other layout is
    built when `result()` is called. Use it as a context manager (leaving it stops a tracer)."""
    from planner import frameworks
    from planner.layouts import trace_ahead

    bf16 = replace(side, dtype="bfloat16") if side.dtype == "fp8_block128" else side
    if hf is None or not frameworks.of(side).traces(spec, bf16):
        return trace_ahead.Pending(lambda: build_layout(spec, side, hf))
    if bf16 is side:
        return trace_ahead.begin(spec, side, hf)
    from planner.fp8 import quantize_layout

    return trace_ahead.begin(spec, bf16, hf, then=lambda layout: quantize_layout(layout, spec))
