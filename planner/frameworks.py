"""The framework registry: what the compiler knows of each training framework and engine.

One frozen `Framework` record per value of `source.framework` / `target.engine` (the names
`schemas.config` lists, `SOURCES` and `TARGETS`: the registry refuses to import unless it
covers exactly those), each made of its layout module's functions
(`planner/layouts/{megatron,fsdp2,vllm,sglang}.py`, the only home of each rule):

- `check(spec, cfg)`: the rules that need the model spec (`ConfigError` on the first);
- `layout(spec, cfg, hf)`: every rank's physical tensors (`hf`, the model's HF config, is
  read only by a vLLM layout traced from the engine's loader, `planner/layouts/traced.py`);
- `identity(cfg, rank)`: a rank's coordinates in the framework's terms (`schemas/identity.py`);
- `derived(rank_layout)`: the refresh entries of a target rank (`planner/derived.py`);
  sources derive nothing;
- `replicated(cfg)`: whether every rank of a source holds the whole model (the header's
  `source_replicated`, `planner/passes/emit.py`); targets are never asked.

Callers (`planner.validate`, `build_layout` and `start_layout` below, `planner.identities`,
`planner.derived`, `planner.passes.emit`) dispatch through `get`; none names a framework.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from planner.fp8 import quantize_layout
from planner.layouts import fsdp2, megatron, sglang, trace_ahead, traced, vllm
from planner.layouts.base import Layout, RankLayout
from planner.spec import ModelSpec
from schemas.config import SOURCES, TARGETS, ConfigError, SourceConfig, TargetConfig


@dataclass(frozen=True)
class Framework:
    """One framework's or engine's compiler functions (see the module docstring)."""

    name: str
    check: Callable[[ModelSpec, Any], None]
    layout: Callable[[ModelSpec, Any, dict[str, Any] | None], Layout]
    identity: Callable[[Any, int], dict[str, int | str]]
    derived: Callable[[RankLayout], list[dict[str, Any]]]
    traces: Callable[[ModelSpec, Any], bool]
    """Whether `layout` traces the engine's loader (and so needs `hf`; `trace_ahead`)."""
    replicated: Callable[[Any], bool]
    """Whether every rank holds the whole model (a source's fact; false for targets)."""

    @property
    def side(self) -> Literal["source", "target"]:
        """`source` for a training framework (`schemas.config.SOURCES`), else `target`."""
        return "source" if self.name in SOURCES else "target"


def _nothing(rank: RankLayout) -> list[dict[str, Any]]:
    return []


def _never(spec: ModelSpec, cfg: Any) -> bool:
    return False


def _target(cfg: Any) -> bool:
    return False


def _vllm_check(spec: ModelSpec, cfg: TargetConfig) -> None:
    (traced.check if traced.uses_trace(spec, cfg) else vllm.check)(spec, cfg)


def _vllm_layout(spec: ModelSpec, cfg: TargetConfig, hf: dict[str, Any] | None) -> Layout:
    if not traced.uses_trace(spec, cfg):
        return vllm.layout(spec, cfg)
    if hf is None:
        raise ConfigError(f"target.layout: {cfg.layout} (model_type {spec.dims.model_type!r}) "
                          "traces vLLM's loader, which needs the model's HF config; compile "
                          "from a config file")
    return traced.layout(spec, cfg, hf)


FRAMEWORKS: dict[str, Framework] = {fw.name: fw for fw in (
    Framework("megatron", megatron.check, lambda spec, cfg, hf: megatron.layout(spec, cfg),
              megatron.identity, _nothing, _never, megatron.replicated),
    Framework("fsdp2", fsdp2.check, lambda spec, cfg, hf: fsdp2.layout(spec, cfg),
              fsdp2.identity, _nothing, _never, fsdp2.replicated),
    Framework("vllm", _vllm_check, _vllm_layout, vllm.identity, vllm.derived_rank,
              traced.uses_trace, _target),
    Framework("sglang", sglang.check, lambda spec, cfg, hf: sglang.layout(spec, cfg),
              sglang.identity, sglang.derived_rank, _never, _target),
)}
"""Every framework (sources) and engine (targets) the compiler builds, by name, in
`schemas.config`'s order."""
if list(FRAMEWORKS) != [*SOURCES, *TARGETS]:
    raise ImportError(f"planner.frameworks has records for {', '.join(FRAMEWORKS)}; "
                      f"schemas.config's frameworks and engines are "
                      f"{', '.join((*SOURCES, *TARGETS))}: give each one a record here")


def get(name: str, key: str = "framework", side: str | None = None) -> Framework:
    """The record of `name` (on `side`, "source" or "target", if given), or `ConfigError`
    in one line naming `key`, the value and the allowed ones."""
    allowed = [n for n, fw in FRAMEWORKS.items() if side in (None, fw.side)]
    if not isinstance(name, str) or name not in allowed:
        raise ConfigError(f"{key}: {name!r} is not one of {', '.join(allowed)}")
    return FRAMEWORKS[name]


def of(side: SourceConfig | TargetConfig) -> Framework:
    """The record of a config side: `source.framework` or `target.engine`."""
    if isinstance(side, SourceConfig):
        return get(side.framework, "source.framework", "source")
    return get(side.engine, "target.engine", "target")


def build_layout(spec: ModelSpec, side: SourceConfig | TargetConfig,
                 hf: dict[str, Any] | None = None) -> Layout:
    """Pass 2 (`layouts`): the layout of one side, every rank's physical tensors, from its
    framework's or engine's `layout`. A vLLM layout traced from the engine's loader
    (`planner/layouts/traced.py`) needs the model's HF config `hf`."""
    if isinstance(side, TargetConfig) and side.dtype == "fp8_block128":
        return quantize_layout(build_layout(spec, replace(side, dtype="bfloat16"), hf), spec)
    return of(side).layout(spec, side, hf)


def start_layout(spec: ModelSpec, side: TargetConfig, hf: dict[str, Any] | None = None
                 ) -> trace_ahead.Pending:
    """`build_layout(spec, side, hf)`, begun: a traced vLLM target that is not cached starts
    tracing now in a forked process (`planner/layouts/trace_ahead.py`); any other layout is
    built when `result()` is called. Use it as a context manager (leaving it stops a tracer)."""
    bf16 = replace(side, dtype="bfloat16") if side.dtype == "fp8_block128" else side
    if hf is None or not of(side).traces(spec, bf16):
        return trace_ahead.Pending(lambda: build_layout(spec, side, hf))
    if bf16 is side:
        return trace_ahead.begin(spec, side, hf)
    return trace_ahead.begin(spec, bf16, hf, then=lambda layout: quantize_layout(layout, spec))
