"""Compiled plans, executed in one process (local transport), reproduce the targets.

For small models of every family and several layouts each: materialize the source ranks
from random full logical tensors, run the plan with `executor.run_all_local`, and compare
every target tensor bit-exactly with the target layout materialized from the same
logical tensors. fp32 sources exercise the cast (round-to-nearest-even, as torch does).
"""

from __future__ import annotations

import os

import pytest
import torch

from harness.weights import random_full_tensors
from planner.compiler import compile_config
from planner.frameworks import build_layout
from planner.tools.verify import verify_plan
from planner.validate import validate
from schemas.config_load import config_from_dict
from schemas.plan_write import encode_plan, write_plan
from tests.support.local_refit import refit_differs

MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "plans", "models")
DENSE, MOE, MLA = "tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"
MIXTRAL, GLM, GPT_OSS = "tiny-mixtral", "tiny-glm4-moe", "tiny-gpt-oss"

CASES = [
    # model, source, target
    (DENSE, dict(framework="megatron", tp=2), dict(engine="vllm", tp=1, replicas=2)),
    (DENSE, dict(framework="megatron", tp=2, pp=2, dp=2), dict(engine="vllm", tp=4)),
    (DENSE, dict(framework="megatron", tp=4, dtype="float32"), dict(engine="vllm", tp=2,
                                                                     replicas=2)),
    (DENSE, dict(framework="megatron", tp=1, vocab_padding="none", transformer_engine=True),
     dict(engine="sglang", tp=2)),
    (DENSE, dict(framework="fsdp2", dp=3), dict(engine="vllm", tp=2)),
    (DENSE, dict(framework="fsdp2", dp=2, tp=2, dtype="float32"), dict(engine="vllm", tp=8)),
    (MOE, dict(framework="megatron", tp=2, ep=2, dp=2), dict(engine="vllm", tp=2, ep=True)),
    (MOE, dict(framework="megatron", tp=2, ep=2, etp=1, dp=2), dict(engine="vllm", dp=3,
                                                                      ep=True)),
    (MOE, dict(framework="megatron", tp=1, ep=4, dp=4, expert_layout="sequential"),
     dict(engine="vllm", tp=2, replicas=2)),
    (MOE, dict(framework="fsdp2", dp=4, fused_experts=True), dict(engine="sglang", tp=2,
                                                                   ep=True)),
    (MLA, dict(framework="megatron", tp=2, ep=2, dp=2), dict(engine="vllm", tp=2, ep=True)),
    (MLA, dict(framework="megatron", tp=1, pp=3, dtype="float32"), dict(engine="vllm", tp=2,
                                                                        replicas=2)),
    (MLA, dict(framework="fsdp2", dp=3), dict(engine="vllm", tp=4, ep=True)),
    (MIXTRAL, dict(framework="fsdp2", dp=3, fused_experts=True), dict(engine="vllm", tp=2,
                                                                       ep=True)),
    (MIXTRAL, dict(framework="fsdp2", dp=2), dict(engine="vllm", tp=2, replicas=2)),
    (GLM, dict(framework="fsdp2", dp=3, fused_experts=True), dict(engine="vllm", tp=2,
                                                                   ep=True)),
    (GLM, dict(framework="fsdp2", dp=2, dtype="float32"), dict(engine="vllm", tp=2,
                                                                replicas=2)),
    (GLM, dict(framework="megatron", tp=2, ep=2, dp=2), dict(engine="vllm", tp=2, ep=True)),
    # transposed expert pieces (gate_up_proj [E, H, 2I] -> w13 [E, 2k, H]); w2_bias on MoE
    # TP rank 0 only
    (GPT_OSS, dict(framework="fsdp2", dp=3), dict(engine="vllm", tp=2)),
    (GPT_OSS, dict(framework="fsdp2", dp=2, dtype="float32"), dict(engine="vllm", tp=2,
                                                                    ep=True, replicas=2)),
]


def _id(case) -> str:
    model, s, t = case
    s_txt = "-".join(f"{k}{v}" for k, v in s.items() if k != "framework")
    t_txt = "-".join(f"{k}{v}" for k, v in t.items() if k != "engine")
    return f"{model}:{s['framework']}-{s_txt}:{t['engine']}-{t_txt}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_plan_reproduces_targets_bit_exactly(case, tmp_path):

    model, source, target = case
    cfg = config_from_dict({"model": {"config": f"{model}/config.json"}, "source": source,
                            "target": target, "cluster": {"gpus_per_host": 8}},
                           base_dir=MODELS)
    from planner.spec import load_spec

    spec = load_spec(cfg.model_config_path)
    validate(cfg, spec)
    plan = compile_config(cfg, spec)
    assert verify_plan(plan) == []
    path = str(tmp_path / "plan.rplan")
    write_plan(path, plan)
    assert encode_plan(compile_config(cfg, spec)) == encode_plan(plan)  # deterministic

    full = random_full_tensors(spec, seed=7)
    if source.get("dtype") == "float32":  # values bf16 cannot hold: the cast must round
        g = torch.Generator().manual_seed(8)
        full = {k: v.float() + 1e-3 * torch.randn(v.shape, generator=g)
                for k, v in full.items()}
    src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    assert refit_differs(path, src, dst, full) == []  # (target rank, tensor) pairs
