"""A chunked plan of a traced target is compiled from the traced layout: the one compile
driver builds the layouts once, as for any plan, and cuts the chunks from them. Each
target rank's chunks together bind exactly the tensors the unchunked plan binds on it."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from planner.compiler import compile_config
from planner.layouts.traced import uses_trace
from planner.validate import load
from schemas.config import ShadowConfig
from schemas.plan import STAGING, Plan
from tests.support.shipped import ROOT

CONFIG = ROOT / "plans" / "gemma-3-1b_fsdp2-8_vllm-tp1-x8.yaml"
BUDGET = 1 << 30


def _targets(plan: Plan) -> dict[int, set[str]]:
    return {rp.rank: {g.name for g in rp.regions if g.name != STAGING}
            for rp in plan.ranks if rp.role == "target"}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="tracing needs vLLM")
def test_a_traced_target_compiles_to_chunks_of_its_traced_layout() -> None:
    cfg, spec = load(str(CONFIG))
    assert cfg.target.shadow is None and uses_trace(spec, cfg.target)
    whole = _targets(compile_config(cfg, spec))
    chunked = dataclasses.replace(cfg, target=dataclasses.replace(
        cfg.target, shadow=ShadowConfig(budget_bytes=BUDGET)))
    plans = compile_config(chunked, spec)
    assert isinstance(plans, list) and len(plans) > 1
    got: dict[int, set[str]] = {r: set() for r in whole}
    for p in plans:
        for r, names in _targets(p).items():
            assert not got[r] & names  # each tensor in exactly one chunk
            got[r] |= names
    assert got == whole
