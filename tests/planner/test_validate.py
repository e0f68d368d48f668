"""Cross-section rules on real setups: configs people run must pass, near misses must not."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from planner.spec import load_spec, spec_from_hf
from planner.topology import build_topology
from planner.validate import validate
from schemas.config import Config, ModelConfig, SourceConfig, TargetConfig
from schemas.config_load import config_from_dict
from schemas.errors import ConfigError, ConfigErrors

MODELS = Path(__file__).resolve().parents[2] / "plans" / "models"


def _check(model: str, source: dict, target: dict, cluster: dict | None = None) -> int:
    """Validate and return the hosts the setup needs."""
    cfg = config_from_dict({"model": {"config": str(MODELS / model)}, "source": source,
                            "target": target, "cluster": cluster or {}})
    validate(cfg, load_spec(cfg.model_config_path))
    return build_topology(cfg.cluster, cfg.source.world, cfg.target.world).hosts


def test_real_setups_pass() -> None:
    # Qwen3-30B-A3B: Megatron tp 4 x dp 8 with ep 8 (etp = tp = 4; etp*ep = 32 = tp*dp),
    # into 4 vLLM engines of tp 4 with EP: 32 + 16 GPUs = 4 + 2 hosts.
    assert _check("qwen3-30b-a3b", {"framework": "megatron", "tp": 4, "dp": 8, "ep": 8},
                  {"engine": "vllm", "tp": 4, "ep": True, "replicas": 4}) == 6
    # DeepSeek-V3: tp 2, pp 16 (3 + 14 x 4 + 2 = 61 layers), dp 32, ep 64, etp 1
    # (etp*ep = 64 = tp*dp): 1024 GPUs; vLLM tp 16 x 4 engines = 64 GPUs.
    assert _check("deepseek-v3", {"framework": "megatron", "tp": 2, "pp": 16, "dp": 32,
                                  "ep": 64, "etp": 1, "pp_first_stage_layers": 3,
                                  "pp_last_stage_layers": 2},
                  {"engine": "vllm", "tp": 16, "replicas": 4}) == 128 + 8
    # Llama-3.1-70B: FSDP2 over 64 GPUs into 8 SGLang tp 8 engines, colocated 4 + 4 per host.
    assert _check("llama-3.1-70b", {"framework": "fsdp2", "dp": 64},
                  {"engine": "sglang", "tp": 8, "replicas": 8},
                  {"placement": "colocated"}) == 16
    # Kimi-K2: 64 heads; SGLang tp 16 with DP attention 4 (attention tp 4), EP over tp 16
    # (384 experts / 16).
    _check("kimi-k2", {"framework": "megatron", "tp": 8, "pp": 1, "dp": 16, "ep": 32,
                       "etp": 1},
           {"engine": "sglang", "tp": 16, "dp": 4, "dp_attention": True, "ep": True})


@pytest.mark.parametrize("tp, ok", [
    (1, True), (2, True), (4, True),  # 8 kv heads: split evenly
    (16, True),                      # 16 ranks > 8 kv heads: each kv head on 2 ranks
    (32, True),
    (3, False),                      # 3 does not divide 32 query heads
])
def test_gqa_rule_qwen3_8b(tp: int, ok: bool) -> None:
    # Qwen3-8B: 32 query heads, 8 kv heads, F = 12288, V = 151936 (pads to 151936).
    src = {"framework": "megatron", "tp": tp}
    if ok:
        _check("qwen3-8b", src, {"engine": "vllm", "tp": tp})
    else:
        with pytest.raises(ConfigError, match=r"source\.tp: 3 must divide num_attention"):
            _check("qwen3-8b", src, {"engine": "vllm", "tp": tp})


def test_vllm_moe_tp_is_dp_times_tp() -> None:
    # vLLM without EP splits each expert over dp*tp = 4*2 = 8 ranks: I = 100 does not split
    # 8 ways (although tp = 2 alone divides it); with EP the experts stay whole.
    cfg = config_from_dict({"model": {"config": str(MODELS / "tiny-qwen3-moe"),
                                      "overrides": {"moe_intermediate_size": 100}},
                            "source": {"framework": "fsdp2", "dp": 2},
                            "target": {"engine": "vllm", "tp": 2, "dp": 4}})
    spec = load_spec(cfg.model_config_path, overrides=cfg.model.overrides)
    with pytest.raises(ConfigError, match=r"target\.tp: 2 times target\.dp=4 .* must divide "
                                          r"moe_intermediate_size=100"):
        validate(cfg, spec)
    validate(replace(cfg, target=replace(cfg.target, ep=True)), spec)


# ------------------------------------------------ validate and the layouts agree
# Found by the property suite as strict xfails: `validate` passed these, then
# `build_layout` refused them. `validate` now calls each layout's `check`, so both refuse
# with the same line.

_QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=16, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, intermediate_size=16, vocab_size=64,
                  num_hidden_layers=1, tie_word_embeddings=False, num_experts=2,
                  moe_intermediate_size=8, num_experts_per_tok=1)


@pytest.mark.parametrize("side, kv_heads, message", [
    # FSDP2+TP: tp=2 over 1 kv head (Megatron/vLLM replicate a KV head; FSDP2 cannot).
    (SourceConfig("fsdp2", tp=2), 1, "source.tp: 2 must divide num_key_value_heads=1"),
    # FSDP2 fused experts (`experts.gate_up_proj`) column-cut by tp=2 (2 kv heads).
    (SourceConfig("fsdp2", tp=2, fused_experts=True), 2,
     "source.fused_experts: True cannot be combined with source.tp=2"),
    # vLLM EP over tp*dp = 4 ranks with 2 experts: some ranks get none.
    (TargetConfig("vllm", tp=2, dp=2, ep=True), 1, "target.ep: True spreads 2 experts over 4"),
], ids=["fsdp2-tp-over-kv-heads", "fsdp2-fused-experts-tp", "vllm-ep-more-ranks-than-experts"])
def test_validate_agrees_with_the_layouts(side: SourceConfig | TargetConfig, kv_heads: int,
                                         message: str) -> None:
    from planner.frameworks import build_layout

    spec = spec_from_hf({**_QWEN3_MOE, "num_key_value_heads": kv_heads})
    src = side if isinstance(side, SourceConfig) else SourceConfig("fsdp2")
    dst = side if isinstance(side, TargetConfig) else TargetConfig("vllm")
    cfg = Config(model=ModelConfig("hand"), source=src, target=dst)
    with pytest.raises(ConfigError) as by_validate:
        validate(cfg, spec)
    with pytest.raises(ConfigError) as by_layout:
        build_layout(spec, side)
    assert str(by_validate.value).startswith(message)
    assert str(by_layout.value) == str(by_validate.value)


def test_every_independent_error_is_reported() -> None:
    # tp 3 breaks the source (8 heads), tp 5 the target, hosts 9 the cluster: one run
    # names all three.
    cfg = config_from_dict({"model": {"config": str(MODELS / "qwen3-8b")},
                            "source": {"framework": "megatron", "tp": 3},
                            "target": {"engine": "vllm", "tp": 5},
                            "cluster": {"hosts": 9}})
    with pytest.raises(ConfigErrors) as err:
        validate(cfg, load_spec(cfg.model_config_path))
    keys = [str(e).split(":")[0] for e in err.value.errors]
    assert keys == ["source.tp", "target.tp", "cluster.hosts"]


def test_every_section_error_is_reported() -> None:
    with pytest.raises(ConfigErrors) as err:
        config_from_dict({"model": {"config": "x", "num_layers": 0},
                          "source": {"framework": "megatron", "tp": "two", "tpp": 1},
                          "target": {"engine": "vlm"}, "optons": {}})
    keys = sorted(str(e).split(":")[0] for e in err.value.errors)
    assert keys == ["model.num_layers", "optons", "source.tp", "source.tpp", "target.engine"]


@pytest.mark.parametrize("section, keys", [
    # a mistyped value beside a size of 0: both, not the second only once the first is fixed
    ({"target": {"engine": "vlm", "tp": 0}}, ["target.engine", "target.tp"]),
    ({"target": {"engine": "vllm", "tp": 0, "dp": 0, "replicas": 0}},
     ["target.dp", "target.replicas", "target.tp"]),
    ({"source": {"framework": "megatorn", "tp": 0, "pp": 0}},
     ["source.framework", "source.pp", "source.tp"]),
    # a stand-in for the missing engine is never reported: only what the file says
    ({"target": {"tp": 0}}, ["target.engine", "target.tp"]),
], ids=["engine-and-tp", "three-sizes", "framework-and-sizes", "missing-engine"])
def test_every_mistake_within_a_section_is_reported(section: dict, keys: list[str]) -> None:
    data = {"model": {"config": "x"}, "source": {"framework": "megatron"},
            "target": {"engine": "vllm"}, **section}
    with pytest.raises(ConfigErrors) as err:
        config_from_dict(data)
    assert sorted(str(e).split(":")[0] for e in err.value.errors) == keys
