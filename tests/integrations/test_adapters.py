"""Acceptance: the Megatron-Core and FSDP2 adapters with real frameworks, over NIXL.

Each case compiles a plan, then runs every source rank as a process that builds its real
model (Megatron-Core 0.16.1 on CPU over gloo, or transformers + FSDP2 `fully_shard`), loads
the test's logical weights, and calls only the adapter and the executor; every target rank
is a plain process binding what `schemas.tensors.rank_tensors` lists. Targets check every
tensor bit-exactly against the target layout after each of 2 steps (`worker.py`). The
chunked cases compile a chunked plan (`target.shadow: {budget_bytes: N}`, several chunks
per target): the same adapters bind it, the sources send it through the trainer path
(`integrations.trainer.load`, `executor.run_chunks`) after it refused each chunked part for
another source rank's identity, and the targets receive it chunk by chunk.
"""

from __future__ import annotations

import pytest

from harness.launch import master_store
from planner.validate import load
from tests.support.integration import compile_plan, run_workers
from tests.support.models import deepseek_v3, qwen3, qwen3_moe

pytest.importorskip("nixl")
pytestmark = pytest.mark.oracle

def run_job(tmp, role: str, hf: dict, source: dict, target: dict, extra: dict | None = None
            ) -> list[str]:
    config, plan = compile_plan(str(tmp), hf, source, target)
    cfg, _ = load(config)
    store, port = master_store(60)  # noqa: F841 (alive while the ranks run)
    base = {"plan": plan, "config": config, "hf": hf, "store": f"127.0.0.1:{port}",
            "steps": 2, "sources": cfg.source.world, **(extra or {})}
    jobs = [{**base, "role": role, "index": i} for i in range(cfg.source.world)]
    jobs += [{**base, "role": "target", "index": i} for i in range(cfg.target.world)]
    done = run_workers(jobs)
    for j, f in zip(jobs, done):
        assert f.returncode == 0, f"{j['role']} {j['index']} failed:\n{f.output[-4000:]}"
    return [f.output for f in done]


CHUNK = 8 << 10
"""A chunked plan's buffer: several chunks on every target rank of these tiny models."""


def _check_targets(outs: list[str], targets: int) -> None:
    for i, out in enumerate(outs[-targets:]):
        assert f"target {i}: plan rank" in out and "step 1:" in out and "bit-exact" in out, out


def _check_chunked_sources(outs: list[str], sources: int) -> None:
    for out in outs[:sources]:
        assert out.count("refused chunked rank") == 2 and "step 1 sent" in out, out


@pytest.mark.parametrize("hf, source, target, extra", [
    # TP2 x PP2 with 2 virtual chunks, bf16 parameters (Float16Module) -> vLLM TP 2
    pytest.param(qwen3(num_hidden_layers=4), dict(framework="megatron", tp=2, pp=2, vpp=2),
                 dict(engine="vllm", tp=2), {"float16_module": True}, id="tp2-pp2-vpp2-bf16"),
    # MLA + shared experts + router.expert_bias (fp32 under Float16Module), EP2 ETP1 with
    # TP2 DP2 (expert DP 2)
    pytest.param(deepseek_v3(num_hidden_layers=2),
                 dict(framework="megatron", tp=2, dp=2, ep=2, etp=1,
                      expert_layout="sequential"),
                 dict(engine="vllm", tp=2, ep=True), {"float16_module": True},
                 id="deepseek-ep2-etp1-dp2-bf16"),
    # the first case's model, a chunked plan
    pytest.param(qwen3(num_hidden_layers=4), dict(framework="megatron", tp=2, pp=2, vpp=2),
                 dict(engine="vllm", tp=2, shadow={"budget_bytes": CHUNK}),
                 {"float16_module": True, "chunked": True}, id="tp2-pp2-vpp2-bf16-chunked"),
])
def test_megatron_adapter_bit_exact(tmp_path, hf, source, target, extra):
    pytest.importorskip("megatron.core")
    outs = run_job(tmp_path, "megatron", hf, source, target, extra)
    _check_targets(outs, target["tp"])
    if extra.get("chunked"):
        _check_chunked_sources(outs, len(outs) - target["tp"])


@pytest.mark.parametrize("hf, source, target", [
    # 4 experts over 3 FSDP ranks: 2, 2, 0 (an empty shard); default fully_shard mesh
    pytest.param(qwen3_moe(intermediate_size=48, mlp_only_layers=[0]),
                 dict(framework="fsdp2", dp=3, dtype="float32", fused_experts=True),
                 dict(engine="vllm", tp=2), id="fsdp2-dp3-empty-shard"),
    # HSDP: 2 replicas x 2 shards
    pytest.param(qwen3(), dict(framework="fsdp2", dp=2, dp_replicate=2, dtype="float32"),
                 dict(engine="vllm", tp=1, replicas=2), id="hsdp-2x2"),
    # the same HSDP job, a chunked plan
    pytest.param(qwen3(), dict(framework="fsdp2", dp=2, dp_replicate=2, dtype="float32"),
                 dict(engine="vllm", tp=1, replicas=2, shadow={"budget_bytes": CHUNK}),
                 id="hsdp-2x2-chunked"),
])
def test_fsdp2_adapter_bit_exact(tmp_path, hf, source, target):
    transformers = pytest.importorskip("transformers")
    if source.get("fused_experts") and int(transformers.__version__.split(".")[0]) < 5:
        source = dict(source, fused_experts=False)
    chunked = "shadow" in target
    outs = run_job(tmp_path, "fsdp2", hf, source, target, {"chunked": chunked})
    targets = target["tp"] * target.get("replicas", 1)
    _check_targets(outs, targets)
    if chunked:
        _check_chunked_sources(outs, len(outs) - targets)
