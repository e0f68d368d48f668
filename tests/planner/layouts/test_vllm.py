"""vLLM target layout: hand-computed shards and a coverage property over random models."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner.layouts import vllm
from planner.layouts.base import Piece
from planner.spec import ModelSpec, spec_from_hf
from schemas.config import ConfigError, TargetConfig
from tests.support.models import deepseek_v3, qwen3, qwen3_moe, tiny_specs
from tests.support.targets import TP_SPLIT, check_coverage, check_replicas, names, tensor


def target(**kw: object) -> TargetConfig:
    return TargetConfig(engine="vllm", **kw)  # type: ignore[arg-type]


def test_qkv_with_kv_replication() -> None:
    # nh=8, ng=2, hd=4, H=16, TP=4: each rank has 2 q heads (8 rows) and kv head t//2.
    # rank 1: q rows [8,16), k/v head 0 rows [0,4);  rank 2: q rows [16,24), kv head 1.
    lay = vllm.layout(spec_from_hf(qwen3()), target(tp=4))
    p = "model.layers.0.self_attn."
    qkv = tensor(lay, 1, p + "qkv_proj.weight")
    assert qkv.shape == (16, 16)
    assert qkv.pieces == (Piece(p + "q_proj.weight", (8, 0), (8, 16), (0, 0)),
                          Piece(p + "k_proj.weight", (0, 0), (4, 16), (8, 0)),
                          Piece(p + "v_proj.weight", (0, 0), (4, 16), (12, 0)))
    assert tensor(lay, 2, p + "qkv_proj.weight").pieces[1].offsets == (4, 0)
    # o_proj [16, 32] is row-parallel: rank 3 holds columns [24, 32).
    o = tensor(lay, 3, p + "o_proj.weight")
    assert o.shape == (16, 8) and o.pieces == (Piece(p + "o_proj.weight", (0, 24), (16, 8),
                                                     (0, 0)),)


def test_qkv_kv_split_and_bias() -> None:
    # qwen2: nh=8, ng=4, hd=4, TP=2: rank 1 = q heads 4-7 (rows [16,32)), kv heads 2-3.
    lay = vllm.layout(spec_from_hf(qwen3(model_type="qwen2", num_key_value_heads=4)),
                      target(tp=2))
    p = "model.layers.1.self_attn."
    bias = tensor(lay, 1, p + "qkv_proj.bias")
    assert bias.shape == (32,)
    assert [(x.tensor, x.offsets, x.at) for x in bias.pieces] == [
        (p + "q_proj.bias", (16,), (0,)), (p + "k_proj.bias", (8,), (16,)),
        (p + "v_proj.bias", (8,), (24,))]
    assert p + "q_norm.weight" not in names(lay, 0)


def test_gate_up_and_vocab_padding() -> None:
    # F=32, TP=4: rank 2 gate_up = [gate rows 16..24; up rows 16..24], down cols [16,24).
    # V=100 pads to 128, per=32: rank 3 holds rows [96,100) then 28 padding rows.
    lay = vllm.layout(spec_from_hf(qwen3()), target(tp=4))
    gu = tensor(lay, 2, "model.layers.0.mlp.gate_up_proj.weight")
    assert gu.shape == (16, 16)
    assert [(x.tensor[-16:], x.offsets, x.at) for x in gu.pieces] == [
        ("gate_proj.weight", (16, 0), (0, 0)), ("p.up_proj.weight", (16, 0), (8, 0))]
    emb = tensor(lay, 3, "model.embed_tokens.weight")
    assert emb.shape == (32, 16)
    assert emb.pieces == (Piece("model.embed_tokens.weight", (96, 0), (4, 16), (0, 0)),)
    head = tensor(lay, 0, "lm_head.weight")
    assert head.pieces == (Piece("lm_head.weight", (0, 0), (32, 16), (0, 0)),)


def test_tied_lm_head_and_pp() -> None:
    # 3 layers, PP 2: vLLM gives the remainder to the stages before the last: [2, 1].
    # Tied: the embedding sits on stage 0 and on the last stage (as lm_head); no lm_head name.
    spec = spec_from_hf(qwen3(num_hidden_layers=3, tie_word_embeddings=True))
    lay = vllm.layout(spec, target(pp=2))
    first, last = names(lay, 0), names(lay, 1)
    assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" in last
    assert "model.layers.1.mlp.down_proj.weight" in first
    assert "model.layers.2.mlp.down_proj.weight" in last
    assert not any(n.startswith("model.layers.2.") for n in first)
    assert "model.norm.weight" in last and "model.norm.weight" not in first
    assert not any(n.startswith("lm_head") for n in first + last)


def test_qwen3_moe_head_on_every_stage() -> None:
    # vLLM's Qwen3MoeModel builds embed_tokens, norm and lm_head on every PP stage.
    lay = vllm.layout(spec_from_hf(qwen3_moe()), target(pp=2))
    for rank in (0, 1):
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(
            names(lay, rank))


def test_rank_numbering() -> None:
    # tp=2, pp=2, dp=2, 2 replicas: rank 13 = replica 1, local 5 = (d=1, p=0, t=1).
    lay = vllm.layout(spec_from_hf(qwen3(num_hidden_layers=2)),
                      target(tp=2, pp=2, dp=2, replicas=2))
    assert lay.world == 16 and lay.ranks[13].replica == 1
    assert "model.layers.0.mlp.down_proj.weight" in names(lay, 13)
    down = tensor(lay, 13, "model.layers.0.mlp.down_proj.weight")
    assert down.pieces[0].offsets == (0, 16)  # TP rank 1 of F=32


def test_experts_ep_uneven() -> None:
    # E=8 over EP = dp*tp = 3 (dp=3, tp=1), linear placement: 0-2, 3-5, 6-7.
    # Rank 2: w13 [2, 2I=16, H=16] = per expert [gate; up]; w2 [2, 16, 8].
    spec = spec_from_hf(qwen3_moe(num_experts=8, num_attention_heads=6, num_key_value_heads=3))
    lay = vllm.layout(spec, target(dp=3, ep=True))
    p = "model.layers.0.mlp."
    w13 = tensor(lay, 2, p + "experts.routed_experts.w13_weight")
    assert w13.shape == (2, 16, 16)
    assert [(x.tensor, x.at) for x in w13.pieces] == [
        (p + "experts.6.gate_proj.weight", (0, 0, 0)), (p + "experts.6.up_proj.weight", (0, 8, 0)),
        (p + "experts.7.gate_proj.weight", (1, 0, 0)), (p + "experts.7.up_proj.weight", (1, 8, 0))]
    assert tensor(lay, 0, p + "experts.routed_experts.w2_weight").shape == (3, 16, 8)
    w2 = tensor(lay, 2, p + "experts.routed_experts.w2_weight")
    assert w2.pieces[1] == Piece(p + "experts.7.down_proj.weight", (0, 0), (16, 8), (1, 0, 0))


def test_experts_tp_over_dp_and_old_names() -> None:
    # No EP, dp=2, tp=2: MoE TP 4 over flat rank d*tp+t; I=8 -> 2 rows per rank.
    # Rank 2 (d=1, t=0) holds gate/up rows [4,6) of every expert, down cols [4,6).
    lay = vllm.layout(spec_from_hf(qwen3_moe()), target(dp=2, tp=2, expert_names="experts"))
    w13 = tensor(lay, 2, "model.layers.1.mlp.experts.w13_weight")
    assert w13.shape == (4, 4, 16)
    assert w13.pieces[1] == Piece("model.layers.1.mlp.experts.0.up_proj.weight", (4, 0),
                                  (2, 16), (0, 2, 0))
    assert tensor(lay, 2, "model.layers.1.mlp.experts.w2_weight").pieces[0].offsets == (0, 4)
    # attention is split by t only: rank 2 holds the same q rows as rank 0.
    assert tensor(lay, 2, "model.layers.1.self_attn.qkv_proj.weight") == tensor(
        lay, 0, "model.layers.1.self_attn.qkv_proj.weight")


def test_mla_and_shared_experts() -> None:
    # nh=4, q_lora 8, kv_lora 8, nope 4, rope 2, v 4, TP 2:
    # fused_qkv_a_proj = [q_a_proj (8 rows); kv_a_proj_with_mqa (10 rows)] replicated;
    # q_b_proj rows [12, 24) (2 heads x 6), kv_b_proj rows [16, 32), o_proj cols [8, 16).
    spec = spec_from_hf(deepseek_v3())
    lay = vllm.layout(spec, target(tp=2))
    p = "model.layers.1.self_attn."
    fused = tensor(lay, 1, p + "fused_qkv_a_proj.weight")
    assert fused.shape == (18, 16)
    assert [(x.tensor, x.sizes, x.at) for x in fused.pieces] == [
        (p + "q_a_proj.weight", (8, 16), (0, 0)),
        (p + "kv_a_proj_with_mqa.weight", (10, 16), (8, 0))]
    assert tensor(lay, 1, p + "q_b_proj.weight").pieces[0].offsets == (12, 0)
    assert tensor(lay, 1, p + "kv_b_proj.weight").pieces[0].offsets == (16, 0)
    assert tensor(lay, 1, p + "o_proj.weight").pieces[0].offsets == (0, 8)
    bias = tensor(lay, 1, "model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.dtype == "float32" and bias.shape == (4,)
    shared = tensor(lay, 1, "model.layers.1.mlp.shared_experts.gate_up_proj.weight")
    assert shared.shape == (8, 16)  # [gate rows 4..8; up rows 4..8] of I_shared=8
    assert not any(".layers.3." in n for n in names(lay, 0))  # MTP layer not loaded


@pytest.mark.parametrize(("model", "cfg", "key"), [
    (qwen3(), dict(tp=3), "target.tp"),                       # 8 heads
    (qwen3(num_attention_heads=12, num_key_value_heads=4), dict(tp=3), "target.tp"),  # kv 4
    # heads, kv heads and F divide by 3, but V=100 pads to 128, which does not
    (qwen3(num_attention_heads=6, num_key_value_heads=3, intermediate_size=24), dict(tp=3),
     "target.tp: 3 must divide the padded vocab 128"),
    (qwen3(num_hidden_layers=2), dict(pp=3), "target.pp"),
    (qwen3_moe(num_experts=4), dict(tp=2, dp=4, ep=True), "target.ep"),
    (qwen3_moe(moe_intermediate_size=6), dict(tp=4), "target.tp"),
])
def test_bad_configs(model: dict, cfg: dict, key: str) -> None:
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.")):
        vllm.layout(spec_from_hf(model), target(**cfg))


def vllm_expected(spec: ModelSpec, cfg: TargetConfig) -> Callable[[str], int]:
    d = spec.dims

    def expected(name: str) -> int:
        stages = 1
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            if d.model_type == "qwen3_moe":
                stages = cfg.pp
            elif name == "model.embed_tokens.weight" and d.tied and cfg.pp > 1:
                stages = 2
        if ".experts." in name and ".shared_experts." not in name:
            return stages  # each routed expert element on exactly one rank of the stage
        if ".shared_experts." in name and cfg.ep and cfg.tp > 1 and cfg.dp > 1:
            return stages * cfg.dp * cfg.tp  # sequence-parallel MoE: replicated
        if ".k_proj." in name or ".v_proj." in name:
            return stages * cfg.dp * max(1, cfg.tp // d.kv_heads)
        if any(k in name for k in TP_SPLIT):
            return stages * cfg.dp
        return stages * cfg.dp * cfg.tp

    return expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                                  HealthCheck.too_slow])
@given(spec=tiny_specs(), tp=st.sampled_from([1, 2, 4]), dp=st.integers(1, 3),
       pp=st.integers(1, 3), ep=st.booleans(), replicas=st.integers(1, 2))
def test_coverage_property(spec: ModelSpec, tp: int, dp: int, pp: int, ep: bool,
                           replicas: int) -> None:
    cfg = target(tp=tp, dp=dp, pp=pp, ep=ep, replicas=replicas)
    try:
        lay = vllm.layout(spec, cfg)
    except ConfigError:
        assume(False)
    check_replicas(lay, cfg.engine_world)
    check_coverage(spec, lay, vllm_expected(spec, cfg))
