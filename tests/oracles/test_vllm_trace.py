"""Oracle: layouts traced from real vLLM 0.33's `load_weights` (`planner/layouts/traced.py`)
equal the hand-written vLLM rules (`planner/layouts/vllm.py`) piece for piece, for all five
hand-written families; arithmetic in a loader and unknown models are refused in one line.

One process (vLLM's import, ~15 s, is paid once); every trace runs on the meta device with
vLLM's parallel state faked per rank, so no process group is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from planner.layouts import traced, vllm, vllm_trace  # noqa: F401 (sets VLLM_TARGET_DEVICE)
from planner.spec import spec_from_hf
from schemas.config import ConfigError, TargetConfig
from tests.support import oracles
from tests.support.engine_models import deepseek_v3, llama, qwen2, qwen3, qwen3_moe

pytestmark = pytest.mark.oracle
oracles.require("vllm")

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "llama tp2": (llama(), dict(tp=2)),
    "llama tp4 kv-replication": (llama(), dict(tp=4)),
    "llama tp1 tied": (llama(tie_word_embeddings=True), dict(tp=1)),
    "qwen2 tp2 qkv-bias": (qwen2(), dict(tp=2)),
    "qwen2 tp2 tied": (qwen2(tie_word_embeddings=True), dict(tp=2)),
    "qwen3 tp2": (qwen3(), dict(tp=2)),
    "qwen3 tp4 kv-replication": (qwen3(), dict(tp=4)),
    "qwen3 tp2 tied": (qwen3(tie_word_embeddings=True), dict(tp=2)),
    "qwen3 pp2 tied": (qwen3(tie_word_embeddings=True), dict(tp=1, pp=2)),
    "qwen3 tp2 pp2 bf16": (qwen3(), dict(tp=2, pp=2, dtype="bfloat16")),
    "qwen3_moe tp2": (qwen3_moe(), dict(tp=2)),
    "qwen3_moe ep2": (qwen3_moe(), dict(tp=2, ep=True)),
    "qwen3_moe ep3 uneven": (qwen3_moe(), dict(tp=3, ep=True)),
    "qwen3_moe pp2": (qwen3_moe(), dict(tp=1, pp=2)),
    "deepseek_v3 tp2": (deepseek_v3(), dict(tp=2)),
    "deepseek_v3 ep2": (deepseek_v3(), dict(tp=2, ep=True)),
    "deepseek_v3 ep3": (deepseek_v3(), dict(tp=3, ep=True)),
    "deepseek_v3 pp2": (deepseek_v3(), dict(tp=1, pp=2)),
    # vLLM's sequence-parallel MoE (EP, TP > 1, DP > 1) replicates the shared experts: the
    # trace found the hand-written rule TP-splitting them here
    "deepseek_v3 dp2 tp2 ep": (deepseek_v3(), dict(dp=2, tp=2, ep=True)),
    "deepseek_v3 dp2 tp2": (deepseek_v3(), dict(dp=2, tp=2)),
    "qwen3_moe dp2 ep": (qwen3_moe(), dict(dp=2, tp=1, ep=True)),
    "qwen3_moe tp2 pp2 dp2 ep bf16": (qwen3_moe(), dict(tp=2, pp=2, dp=2, ep=True,
                                                       dtype="bfloat16")),
    "llama tp2 pp2 tied": (llama(tie_word_embeddings=True), dict(tp=2, pp=2)),
    "deepseek_v3 no q_lora tp2": (deepseek_v3(q_lora_rank=None), dict(tp=2)),
    "kimi_k2 ep2": (deepseek_v3(model_type="kimi_k2", first_k_dense_replace=2),
                    dict(tp=2, ep=True)),
    "qwen3_moe dp2 no-ep": (qwen3_moe(), dict(dp=2, tp=1)),
    # enough alike layers that some are extrapolated, not traced (trace_layers): MoE
    # layers 1-6 trace 1, 3, 6; PP 2 splits the classes by stage
    "deepseek_v3 7 layers ep2": (deepseek_v3(num_hidden_layers=7), dict(tp=2, ep=True)),
    "qwen3_moe 9 layers tp2 pp2": (qwen3_moe(num_hidden_layers=9), dict(tp=2, pp=2)),
    "llama 8 layers tp2 tied": (llama(num_hidden_layers=8, tie_word_embeddings=True),
                                dict(tp=2)),
}


def target(**kw: Any) -> TargetConfig:
    return TargetConfig(engine="vllm", layout="traced", **({"dtype": "float32"} | kw))


@pytest.mark.parametrize("name", sorted(CASES))
def test_trace_equals_hand_written(name: str, tmp_path: Path) -> None:
    hf, kw = CASES[name]
    spec, cfg = spec_from_hf(hf, mtp=False), target(replicas=2, **kw)
    got = traced.layout(spec, cfg, hf, str(tmp_path))
    want = vllm.layout(spec, cfg)
    assert got.world == want.world == 2 * cfg.engine_world
    for g, w in zip(got.ranks, want.ranks, strict=True):
        assert (g.rank, g.replica) == (w.rank, w.replica)
        assert [t.name for t in g.tensors] == [t.name for t in w.tensors], f"rank {g.rank}"
        for a, b in zip(g.tensors, w.tensors):
            assert a == b, f"{name} rank {g.rank}: traced {a}\n  hand-written {b}"


def test_trace_is_cached_and_replicas_reuse_it(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    hf, kw = CASES["qwen3_moe ep2"]
    spec = spec_from_hf(hf, mtp=False)
    first = traced.layout(spec, target(**kw), hf, str(tmp_path))
    files = list((tmp_path / "traced").iterdir())
    assert len(files) == 1

    def no_trace(*a: object) -> None:
        raise AssertionError("traced again although cached")

    monkeypatch.setattr(traced, "_trace", no_trace)
    again = traced.layout(spec, target(replicas=3, **kw), hf, str(tmp_path))
    assert again.ranks[:2] == first.ranks and again.world == 6
    assert again.ranks[4].tensors == first.ranks[0].tensors
    # another parallel config is another key: it must trace (here: refused by the stub)
    with pytest.raises(AssertionError, match="traced again"):
        traced.layout(spec, target(tp=2), hf, str(tmp_path))


def test_a_model_class_vllm_has_not_cached_is_inspected_in_this_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fresh machine vLLM inspects each model class in a new Python process (a second
    import of vLLM, seconds per family); the trace inspects it in its own, and vLLM's
    cache of it is still written."""
    from vllm.model_executor.models import registry

    started: list[object] = []

    def new_process(fn: Any) -> Any:
        started.append(fn)
        return fn()

    monkeypatch.setattr(registry, "_run_in_subprocess", new_process)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))  # nothing cached
    registry._try_inspect_model_cls.cache_clear()  # nor inspected in this process
    hf, kw = CASES["qwen2 tp2 qkv-bias"]
    spec, cfg = spec_from_hf(hf, mtp=False), target(**kw)
    assert traced.layout(spec, cfg, hf, str(tmp_path)) == vllm.layout(spec, cfg)
    assert started == []
    assert [p.name for p in (tmp_path / "vllm" / "modelinfos").iterdir()] == [
        "vllm-model_executor-models-qwen2-Qwen2ForCausalLM.json"]


def test_arithmetic_in_a_loader_is_refused_naming_the_parameter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.linear import RowParallelLinear

    real = RowParallelLinear.weight_loader_v2  # the unquantized path's loader

    def scaling_loader(self: Any, param: Any, loaded_weight: Any) -> None:
        real(self, param, loaded_weight * 2)  # arithmetic: not a view, slice or copy

    monkeypatch.setattr(RowParallelLinear, "weight_loader_v2", scaling_loader)
    hf, kw = CASES["qwen3 tp2"]
    with pytest.raises(ConfigError) as e:
        traced.layout(spec_from_hf(hf, mtp=False), target(**kw), hf, str(tmp_path))
    msg = str(e.value)
    assert "model.layers.0.self_attn.o_proj.weight" in msg and "mul" in msg, msg
    assert "\n" not in msg


def test_unknown_model_type_lists_what_is_supported(tmp_path: Path) -> None:
    hf = qwen3(model_type="frobnicator", architectures=["FrobnicatorForCausalLM"])
    with pytest.raises(ConfigError) as e:
        traced.layout(spec_from_hf(qwen3(), mtp=False), target(tp=1), hf, str(tmp_path))
    msg = str(e.value)
    assert "'frobnicator'" in msg and "neither transformers" in msg and "\n" not in msg
    for supported in ("qwen3_moe", "deepseek_v3", "LlamaForCausalLM", "Glm4MoeForCausalLM",
                      "GptOssForCausalLM", "MixtralForCausalLM"):
        assert supported in msg


def test_vllm_refuses_an_engine_in_one_line(tmp_path: Path) -> None:
    hf = qwen3_moe()  # 6 heads: TP 4 does not divide them; vLLM's own check says so
    with pytest.raises(ConfigError, match="target: vLLM refuses this engine.*divisible"):
        traced.layout(spec_from_hf(hf, mtp=False), target(tp=4), hf, str(tmp_path))


def test_a_platform_vllm_settled_before_the_planner_loaded_is_named() -> None:
    """On a box with no GPU, touching vLLM's platform before VLLM_TARGET_DEVICE=cpu is set
    settles it on one with no device (a fresh CI venv did so at collection); the trace says
    so in one line naming the variable, not "fix target tp/pp/dp/ep"."""
    import os
    import subprocess
    import sys

    code = ("import vllm.platforms as p; assert not p.current_platform.device_type\n"
            "from planner.layouts import vllm_trace\n"
            "from tests.support.engine_models import qwen3\n"
            "from planner.spec import spec_from_hf\n"
            "from schemas.config import TargetConfig\n"
            "hf = qwen3(); cfg = TargetConfig(engine='vllm', tp=2, dtype='float32')\n"
            "vllm_trace.trace_engine(spec_from_hf(hf, mtp=False), hf, cfg, 1)\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(env, PYTHONPATH=root),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "no device" in last and "VLLM_TARGET_DEVICE=cpu" in last, last


MODELS = Path(__file__).resolve().parents[2] / "plans" / "models"


@pytest.mark.parametrize("model,target_kw", [
    ("tiny-qwen3-moe", dict(tp=2, ep=True, replicas=2)),
    ("tiny-deepseek-v3", dict(tp=2)),
    ("tiny-gemma3", dict(tp=2, replicas=2)),  # no hand-written rules: auto traces
])
def test_fsdp2_to_traced_vllm_end_to_end_bit_exact(model: str, target_kw: dict, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile FSDP2 -> vLLM with traced target layouts, run the plan with `run_all_local`,
    and compare every target tensor with the hand-written layout (checked against real vLLM
    by test_vllm_oracle.py) materialized from the same logical tensors; a family without
    hand-written rules (gemma3_text) against its traced layout, which test_vllm_oracle.py
    checks against real vLLM's loaded parameters."""
    import torch

    import executor
    from harness.weights import materialize, random_full_tensors
    from planner.compiler import compile_config
    from planner.frameworks import build_layout
    from planner.spec import load_spec
    from planner.validate import validate
    from schemas.config_load import config_from_dict
    from schemas.plan_write import write_plan

    monkeypatch.setenv("RDMA_PLAN_CACHE", str(tmp_path / "cache"))
    cfg = config_from_dict({"model": {"config": f"{model}/config.json"},
                            "source": {"framework": "fsdp2", "dp": 3},
                            "target": {"engine": "vllm", **target_kw,
                                       **({} if model == "tiny-gemma3" else
                                          {"layout": "traced"})},
                            "cluster": {"gpus_per_host": 8}}, base_dir=str(MODELS))
    spec = load_spec(cfg.model_config_path)
    validate(cfg, spec)
    plan = compile_config(cfg, spec)
    assert list((tmp_path / "cache" / "traced").iterdir())  # the trace ran and was cached
    path = str(tmp_path / "plan.rplan")
    write_plan(path, plan)
    full = random_full_tensors(spec, seed=11)
    src = build_layout(spec, cfg.source)
    tensors = materialize(src, full)
    if spec.dims.model_type in traced.HAND_WRITTEN:
        want = materialize(vllm.layout(spec, cfg.target), full)
    else:
        want = materialize(traced.layout(spec, cfg.target, traced.model_hf(cfg)), full)
    for r, ts in want.items():
        tensors[src.world + r] = {k: torch.zeros_like(v) for k, v in ts.items()}
    executor.run_all_local(path, tensors)
    for r, ts in want.items():
        for name, w in ts.items():
            assert torch.equal(tensors[src.world + r][name], w), f"target rank {r} {name}"


def test_a_disagreeing_layer_class_traces_the_rank_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When a traced representative disagrees with its class (`extrapolate` gives None;
    its detection is tests/planner/layouts/test_trace_layers.py), every layer is traced."""
    from planner.layouts import trace_layers

    calls: list[int] = []

    def disagree(*a: Any) -> None:
        calls.append(1)

    monkeypatch.setattr(trace_layers, "extrapolate", disagree)
    hf, kw = CASES["deepseek_v3 7 layers ep2"]
    spec, cfg = spec_from_hf(hf, mtp=False), target(**kw)
    monkeypatch.setattr(vllm_trace.os, "cpu_count", lambda: 1)  # in this process
    got = traced.layout(spec, cfg, hf, str(tmp_path))
    assert calls == [1, 1] and got == vllm.layout(spec, cfg)
