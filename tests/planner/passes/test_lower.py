"""Regressions of the lower pass (`planner/passes/lower.py`), geometry spelled out; found
by the property suite (tests/property/)."""

from __future__ import annotations

from planner.compiler import compile_layouts
from planner.spec import spec_from_hf
from planner.verify import verify_plan
from schemas.plan import STAGING
from tests.support.synthetic import TINY, whole_tensors
from tests.support.synthetic import tiny_config as config


def test_staging_budget_not_a_multiple_of_64() -> None:
    # 1 fp32 source rank -> 1 bf16 target rank, whole tensors: every tensor is cast, so
    # every chunk is packed into the source's staging. staging_bytes=150: stage 0 takes
    # embed_tokens (128 bytes at 0; the next offset is aligned to 128) and then
    # input_layernorm (16 bytes, fits: 128 + 16 <= 150) at 128; the staging region is
    # then sized to the aligned end 128 + 64 = 192 > 150.
    spec = spec_from_hf(TINY)
    plan = compile_layouts(config(max_write_bytes=4096, staging_bytes=150), spec,
                           whole_tensors(spec, "source", "float32"),
                           whole_tensors(spec, "target", "bfloat16"))
    staging = [r.nbytes for rp in plan.ranks for r in rp.regions if r.name == STAGING]
    assert max(staging) <= 150
    assert verify_plan(plan) == []

