"""SGLang target layout: its differences from vLLM, and the coverage property."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.derived import derived
from planner.layouts import sglang
from planner.layouts.base import Piece
from planner.spec import ModelSpec, spec_from_hf
from schemas.config import ConfigError, TargetConfig
from tests.support.models import deepseek_v3, qwen3, qwen3_moe, tiny_specs
from tests.support.targets import TP_SPLIT, check_coverage, check_replicas, names, tensor


def target(**kw: object) -> TargetConfig:
    return TargetConfig(engine="sglang", **kw)  # type: ignore[arg-type]


def test_experts_contiguous_ep() -> None:
    # E=4, tp=2, EP: ep_size = tp = 2, rank 1 owns experts 2-3 whole (MoE TP 1).
    lay = sglang.layout(spec_from_hf(qwen3_moe()), target(tp=2, ep=True))
    w13 = tensor(lay, 1, "model.layers.0.mlp.experts.w13_weight")
    assert w13.shape == (2, 16, 16)
    assert [(x.tensor, x.offsets, x.at) for x in w13.pieces[:2]] == [
        ("model.layers.0.mlp.experts.2.gate_proj.weight", (0, 0), (0, 0, 0)),
        ("model.layers.0.mlp.experts.2.up_proj.weight", (0, 0), (0, 8, 0))]
    with pytest.raises(ConfigError, match=r"^target\.tp: 3 must divide the 6 experts|^target"):
        sglang.layout(spec_from_hf(qwen3_moe(num_experts=8, num_attention_heads=6,
                                             num_key_value_heads=3, intermediate_size=24,
                                             vocab_size=64 * 3)), target(tp=3, ep=True))


def test_dp_attention() -> None:
    # tp=4, dp=2, DP attention: world 4; attention TP 2 (rank t -> attention rank t % 2).
    # nh=8, ng=2, hd=4: rank 3 = q heads 4-7 (rows [16,32)), kv head 1.
    # embed_tokens split over the attention TP group: [64, 16] (V=100 padded to 128, /2),
    # rank 3 = attention rank 1 = rows [64, 100); lm_head split 4 ways (32 rows).
    cfg = target(tp=4, dp=2, dp_attention=True)
    lay = sglang.layout(spec_from_hf(qwen3()), cfg)
    assert lay.world == 4 == cfg.engine_world
    qkv = tensor(lay, 3, "model.layers.0.self_attn.qkv_proj.weight")
    assert [(x.offsets, x.sizes) for x in qkv.pieces] == [((16, 0), (16, 16)),
                                                           ((4, 0), (4, 16)), ((4, 0), (4, 16))]
    emb = tensor(lay, 3, "model.embed_tokens.weight")
    assert emb.shape == (64, 16)
    assert emb.pieces == (Piece("model.embed_tokens.weight", (64, 0), (36, 16), (0, 0)),)
    assert tensor(lay, 3, "lm_head.weight").pieces[0].offsets == (96, 0)
    # the dense MLP stays split over all 4 ranks: F=32 -> rank 3 down cols [24, 32)
    assert tensor(lay, 3, "model.layers.0.mlp.down_proj.weight").pieces[0].offsets == (0, 24)


def test_dp_without_dp_attention_is_engines() -> None:
    # dp=2, tp=2, no DP attention: two independent engines of 2 ranks in one replica.
    lay = sglang.layout(spec_from_hf(qwen3()), target(tp=2, dp=2))
    assert lay.world == 4
    assert lay.ranks[2].tensors == lay.ranks[0].tensors
    assert {rl.replica for rl in lay.ranks} == {0}


def test_mla_name_and_tied_pp() -> None:
    lay = sglang.layout(spec_from_hf(deepseek_v3()), target(tp=2))
    fused = tensor(lay, 0, "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight")
    assert fused.shape == (18, 16)
    # tied, PP 2: the last stage holds lm_head.weight filled from the embedding.
    lay = sglang.layout(spec_from_hf(qwen3(tie_word_embeddings=True)), target(pp=2))
    assert "model.embed_tokens.weight" not in names(lay, 1)
    head = tensor(lay, 1, "lm_head.weight")
    assert head.pieces[0].tensor == "model.embed_tokens.weight"
    assert not any(n.startswith("lm_head") for n in names(lay, 0))
    # tied, PP 1: lm_head is the embedding, not listed
    lay = sglang.layout(spec_from_hf(qwen3(tie_word_embeddings=True)), target())
    assert not any(n.startswith("lm_head") for n in names(lay, 0))


def test_dp_attention_needs_tp_multiple() -> None:
    with pytest.raises(ConfigError, match=r"^target\.dp: 3"):
        sglang.layout(spec_from_hf(qwen3()), target(tp=4, dp=3, dp_attention=True))


def sglang_expected(spec: ModelSpec, cfg: TargetConfig) -> Callable[[str], int]:
    d = spec.dims
    a = cfg.tp // cfg.dp if cfg.dp_attention else cfg.tp
    engines = 1 if cfg.dp_attention else cfg.dp
    attention = ("self_attn.",)

    def expected(name: str) -> int:
        n = engines
        if name == "model.embed_tokens.weight":
            # first stage (once per DP-attention group), plus lm_head's copy (tied, PP)
            return n * ((cfg.tp // a if cfg.dp_attention else 1) + (d.tied and cfg.pp > 1))
        if name == "lm_head.weight" and d.model_type == "qwen3_moe" and not d.tied:
            return n * cfg.pp  # SGLang's Qwen3-MoE: lm_head on every PP stage
        if ".experts." in name and ".shared_experts." not in name:
            return n
        if any(k in name for k in attention):
            copies = cfg.tp // a  # DP-attention groups
            if ".k_proj." in name or ".v_proj." in name:
                return n * copies * max(1, a // d.kv_heads)
            if any(k in name for k in TP_SPLIT):
                return n * copies
            return n * cfg.tp
        if any(k in name for k in TP_SPLIT):
            return n
        return n * cfg.tp

    return expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                                  HealthCheck.too_slow])
@given(spec=tiny_specs(), tp=st.sampled_from([1, 2, 4]), dp=st.integers(1, 2),
       pp=st.integers(1, 3), ep=st.booleans(), dp_attention=st.booleans(),
       replicas=st.integers(1, 2))
def test_coverage_property(spec: ModelSpec, tp: int, dp: int, pp: int, ep: bool,
                           dp_attention: bool, replicas: int) -> None:
    cfg = target(tp=tp, dp=dp, pp=pp, ep=ep, dp_attention=dp_attention, replicas=replicas)
    try:
        lay = sglang.layout(spec, cfg)
    except ConfigError:
        assume(False)
    check_replicas(lay, cfg.engine_world)
    check_coverage(spec, lay, sglang_expected(spec, cfg))


def test_pp_split_and_moe_head_on_every_stage() -> None:
    # SGLang's get_pp_indices: 5 layers over 3 stages = [0], [1, 2], [3, 4]
    assert [list(sglang.pp_layers(5, 3, s)) for s in range(3)] == [[0], [1, 2], [3, 4]]
    lay = sglang.layout(spec_from_hf(qwen3_moe()), target(tp=2, pp=2))
    # stage 0 (ranks 0, 1) holds lm_head too, the same rows as its last-stage peer
    assert tensor(lay, 1, "lm_head.weight") == tensor(lay, 3, "lm_head.weight")
    assert "model.norm.weight" not in names(lay, 1)


def test_order_is_sglangs() -> None:
    # SGLang's named_parameters() order inside a layer (proven by the oracle)
    lay = sglang.layout(spec_from_hf(qwen3()), target(tp=2))
    layer0 = [n.removeprefix("model.layers.0.") for n in names(lay, 0)
              if n.startswith("model.layers.0.")]
    assert layer0[:4] == ["self_attn.q_norm.weight", "self_attn.k_norm.weight",
                          "self_attn.qkv_proj.weight", "self_attn.o_proj.weight"]
    lay = sglang.layout(spec_from_hf(deepseek_v3()), target(tp=2))
    layer1 = [n.removeprefix("model.layers.1.") for n in names(lay, 0)
              if n.startswith("model.layers.1.")]
    assert layer1.index("self_attn.kv_a_layernorm.weight") > \
        layer1.index("self_attn.o_proj.weight")
    assert layer1.index("mlp.experts.w2_weight") < \
        layer1.index("mlp.shared_experts.gate_up_proj.weight")


def test_derived_lists_every_mla_layer_per_rank() -> None:
    spec = spec_from_hf(deepseek_v3())
    cfg = target(tp=2, pp=2)
    lay = sglang.layout(spec, cfg)
    entries = derived(lay, 2, cfg)  # planner/derived.py, SGLang's rule
    assert len(entries) == 2 + lay.world == 6 and entries[:2] == [[], []]
    # PP 2 of 3 layers (SGLang: remainder on the last stage): stage 0 (ranks 0, 1) holds
    # layer 0, stage 1 (ranks 2, 3) layers 1-2
    assert [[e["module"] for e in r] for r in entries[2:]] == [
        ["model.layers.0.self_attn"]] * 2 + [
        ["model.layers.1.self_attn", "model.layers.2.self_attn"]] * 2
    e = entries[5][1]
    assert e == {"rule": "mla_split", "engine": "sglang", "module": "model.layers.2.self_attn",
                 "reads": ["model.layers.2.self_attn.kv_b_proj.weight"],
                 "writes": ["w_kc", "w_vc"]}
    assert all(r in names(lay, 3) for r in e["reads"])
    cfg = target(tp=2)
    assert derived(sglang.layout(spec_from_hf(qwen3()), cfg), 1, cfg) == [[]] * 3
