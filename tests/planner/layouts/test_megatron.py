"""Megatron-Core source layout: hand-computed shards, then a coverage property.

Notation as in LAYOUTS.md: nh query heads, ng KV groups, hd head dim, H hidden.
A piece is written (logical tensor, logical offsets, sizes, position in the physical one).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.layouts import megatron
from planner.spec import ModelSpec, spec_from_hf
from schemas.config import ConfigError, SourceConfig
from tests.support.coverage import coverage
from tests.support.models import deepseek_v3, qwen3, qwen3_moe, tiny_specs


def cfg(**kw: object) -> SourceConfig:
    return SourceConfig(framework="megatron", **kw)


def tensors(layout, rank: int) -> dict:
    return {t.name: t for t in layout.ranks[rank].tensors}


def short(pt) -> list[tuple]:
    """(last two name parts, offsets, sizes, at) of each piece."""
    return [(".".join(p.tensor.split(".")[-2:]), p.offsets, p.sizes, p.at) for p in pt.pieces]


def test_qkv_cut_inside_a_group():
    # nh=8, ng=2, hd=4, TP=4: linear_qkv rows = [q0 q1 q2 q3 k0 v0 | q4 q5 q6 q7 k1 v1] * hd
    # = 48 rows, 12 per rank: rank 0 = q0..q2, rank 1 = q3, k0, v0, rank 3 = q7, k1, v1.
    lay = megatron.layout(spec_from_hf(qwen3()), cfg(tp=4))
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert tensors(lay, 0)[qkv].shape == (12, 16)
    assert short(tensors(lay, 0)[qkv]) == [("q_proj.weight", (0, 0), (12, 16), (0, 0))]
    assert short(tensors(lay, 1)[qkv]) == [("q_proj.weight", (12, 0), (4, 16), (0, 0)),
                                           ("k_proj.weight", (0, 0), (4, 16), (4, 0)),
                                           ("v_proj.weight", (0, 0), (4, 16), (8, 0))]
    assert short(tensors(lay, 3)[qkv]) == [("q_proj.weight", (28, 0), (4, 16), (0, 0)),
                                           ("k_proj.weight", (4, 0), (4, 16), (4, 0)),
                                           ("v_proj.weight", (4, 0), (4, 16), (8, 0))]
    # linear_proj is row-parallel: rank 1 holds o_proj columns [8, 16) of nh*hd = 32.
    proj = tensors(lay, 1)["decoder.layers.0.self_attention.linear_proj.weight"]
    assert short(proj) == [("o_proj.weight", (0, 8), (16, 8), (0, 0))]


def test_qkv_bias_follows_the_interleave():
    # qwen2, nh=4, ng=2, hd=4, TP=2: rank 1 = group 1 = [q2 q3 k1 v1], bias the same.
    spec = spec_from_hf(qwen3(model_type="qwen2", num_attention_heads=4))
    bias = tensors(megatron.layout(spec, cfg(tp=2)), 1)[
        "decoder.layers.0.self_attention.linear_qkv.bias"]
    assert bias.shape == (16,)
    assert short(bias) == [("q_proj.bias", (8,), (8,), (0,)), ("k_proj.bias", (4,), (4,), (8,)),
                           ("v_proj.bias", (4,), (4,), (12,))]


def test_fc1_is_gate_then_up_per_rank():
    # F=32, TP=2: rank 1 linear_fc1 = [gate rows 16..31; up rows 16..31], fc2 = cols 16..31.
    t = tensors(megatron.layout(spec_from_hf(qwen3()), cfg(tp=2)), 1)
    fc1 = t["decoder.layers.1.mlp.linear_fc1.weight"]
    assert fc1.shape == (32, 16)
    assert short(fc1) == [("gate_proj.weight", (16, 0), (16, 16), (0, 0)),
                          ("up_proj.weight", (16, 0), (16, 16), (16, 0))]
    assert short(t["decoder.layers.1.mlp.linear_fc2.weight"]) == [
        ("down_proj.weight", (0, 16), (16, 16), (0, 0))]


def test_vocab_padding():
    # V=100, TP=2, megatron padding: ceil(100/256)*256 = 256 rows, 128 per rank;
    # rank 0 holds rows 0..99 (28 padding rows), rank 1 only padding.
    spec = spec_from_hf(qwen3())
    lay = megatron.layout(spec, cfg(tp=2))
    emb = "embedding.word_embeddings.weight"
    assert tensors(lay, 0)[emb].shape == (128, 16)
    assert short(tensors(lay, 0)[emb]) == [("embed_tokens.weight", (0, 0), (100, 16), (0, 0))]
    assert tensors(lay, 1)[emb].shape == (128, 16) and tensors(lay, 1)[emb].pieces == ()
    # no padding, TP=4: 25 rows each; rank 2 = rows 50..74 of lm_head.
    lay = megatron.layout(spec, cfg(tp=4, vocab_padding="none"))
    assert short(tensors(lay, 2)["output_layer.weight"]) == [
        ("lm_head.weight", (50, 0), (25, 16), (0, 0))]
    with pytest.raises(ConfigError, match="source.vocab_padding"):
        megatron.layout(spec, cfg(tp=8, vocab_padding="none"))  # 100 % 8


def test_tied_embeddings_and_pp_stages():
    spec = spec_from_hf(qwen3(tie_word_embeddings=True, num_hidden_layers=5))
    names = [t.name for t in megatron.layout(spec, cfg()).ranks[0].tensors]
    assert "output_layer.weight" not in names  # PP=1: the output layer reuses the embedding
    # PP=3, first stage 1 layer: the other 4 split 2 + 2; layer names are stage-local.
    lay = megatron.layout(spec, cfg(pp=3, pp_first_stage_layers=1))
    assert megatron.stage_layers(5, cfg(pp=3, pp_first_stage_layers=1)) == [
        range(0, 1), range(1, 3), range(3, 5)]
    mid = tensors(lay, 1)
    assert short(mid["decoder.layers.1.input_layernorm.weight"]) == [
        ("input_layernorm.weight", (0,), (16,), (0,))]
    assert mid["decoder.layers.1.input_layernorm.weight"].pieces[0].tensor == \
        "model.layers.2.input_layernorm.weight"
    last = tensors(lay, 2)
    assert [p.tensor for p in last["output_layer.weight"].pieces] == [
        "model.embed_tokens.weight"]  # PP>1: the last stage holds a copy
    assert "embedding.word_embeddings.weight" not in last


def test_rank_grid_dense_and_expert():
    # tp=2, dp=2, pp=2: rank = tp + 2*(dp + 2*pp); rank 5 = tp 1, dp 0, pp 1.
    spec = spec_from_hf(qwen3_moe(num_hidden_layers=2))
    lay = megatron.layout(spec, cfg(tp=2, dp=2, pp=2, ep=2, etp=1))
    r5 = lay.ranks[5]
    assert r5.replica == 0
    proj = tensors(lay, 5)["decoder.layers.0.self_attention.linear_proj.weight"]
    assert proj.pieces[0].tensor == "model.layers.1.self_attn.o_proj.weight"
    assert proj.pieces[0].offsets == (0, 16)
    # experts: etp=1, ep=2, edp = 4/2 = 2: rank = ep + 2*(edp + 2*pp); rank 5 = ep 1, edp 0.
    fc1 = tensors(lay, 5)["decoder.layers.0.mlp.experts.linear_fc1.weight1"]
    assert short(fc1) == [("gate_proj.weight", (0, 0), (8, 16), (0, 0)),
                          ("up_proj.weight", (0, 0), (8, 16), (8, 0))]
    assert fc1.pieces[0].tensor == "model.layers.1.mlp.experts.3.gate_proj.weight"


def test_moe_names_grouped_sequential_and_etp():
    spec = spec_from_hf(qwen3_moe(num_hidden_layers=1))
    grouped = [t.name for t in megatron.layout(spec, cfg(ep=2, dp=2)).ranks[0].tensors]
    assert grouped[grouped.index("decoder.layers.0.mlp.router.weight"):][:5] == [
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.0.mlp.experts.linear_fc1.weight0",
        "decoder.layers.0.mlp.experts.linear_fc1.weight1",
        "decoder.layers.0.mlp.experts.linear_fc2.weight0",
        "decoder.layers.0.mlp.experts.linear_fc2.weight1"]
    seq = megatron.layout(spec, cfg(tp=2, expert_layout="sequential", etp=2))
    t = tensors(seq, 1)
    # ETP=2, I=8: expert 3's fc1 on etp rank 1 = [gate rows 4..7; up rows 4..7].
    assert short(t["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]) == [
        ("gate_proj.weight", (4, 0), (4, 16), (0, 0)), ("up_proj.weight", (4, 0), (4, 16),
                                                         (4, 0))]


def test_deepseek_mla_shared_experts_and_expert_bias():
    spec = spec_from_hf(deepseek_v3(num_hidden_layers=2, first_k_dense_replace=1))
    lay = megatron.layout(spec, cfg(tp=2, dtype="bfloat16"))
    t = tensors(lay, 1)
    attn = "decoder.layers.0.self_attention."
    # local spec: down projections column-parallel (q_lora 8 -> 4 rows per rank), norms apart
    assert short(t[attn + "linear_q_down_proj.weight"]) == [
        ("q_a_proj.weight", (4, 0), (4, 16), (0, 0))]
    assert t[attn + "linear_kv_up_proj.weight"].shape == (16, 8)  # 4 heads*(4+4) / TP 2
    assert attn + "q_layernorm.weight" in t and attn + "kv_layernorm.weight" in t
    names = list(t)
    assert names[-1] == "decoder.layers.1.mlp.router.expert_bias"  # buffers last
    assert t[names[-1]].dtype == "float32" and t[attn + "linear_proj.weight"].dtype == "bfloat16"
    assert short(t["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]) == [
        ("gate_proj.weight", (4, 0), (4, 16), (0, 0)), ("up_proj.weight", (4, 0), (4, 16),
                                                         (4, 0))]
    assert not any(".layers.2." in p.tensor for pt in lay.ranks[0].tensors
                   for p in pt.pieces)  # MTP left out
    te = tensors(megatron.layout(spec, cfg(tp=2, transformer_engine=True)), 1)
    assert short(te[attn + "linear_q_down_proj.weight"]) == [
        ("q_a_proj.weight", (0, 0), (8, 16), (0, 0))]  # TE: replicated
    assert attn + "linear_q_up_proj.layer_norm_weight" in te
    assert attn + "q_layernorm.weight" not in te


def test_transformer_engine_names():
    spec = spec_from_hf(qwen3_moe(num_hidden_layers=2, mlp_only_layers=[0]))
    names = [t.name for t in megatron.layout(spec, cfg(transformer_engine=True)).ranks[0].tensors]
    assert names[1:4] == ["decoder.layers.0.self_attention.linear_proj.weight",
                          "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                          "decoder.layers.0.self_attention.linear_qkv.weight"]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names  # dense layer
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in names
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in names  # MoE layer keeps it


@pytest.mark.parametrize("hf, kw, key", [
    (qwen3_moe(), dict(ep=3, dp=3), "source.ep"),
    (qwen3(), dict(tp=3, dp=1), "source.tp"),  # 8 heads
    (qwen3(num_key_value_heads=4, num_attention_heads=12), dict(tp=6), "source.tp"),
    (qwen3(), dict(pp=3), "source.pp"),
    (qwen3(num_hidden_layers=5), dict(pp=2), "source.pp"),
    (qwen3(), dict(pp_first_stage_layers=1), "source.pp_first_stage_layers"),
    (qwen3_moe(), dict(etp=3, dp=3), "source.etp"),
    (qwen3_moe(), dict(ep=4, dp=2), "source.ep"),  # ep*etp=4 > tp*dp=2
])
def test_impossible_configs(hf, kw, key):
    with pytest.raises(ConfigError, match=key):
        megatron.layout(spec_from_hf(hf), cfg(**kw))


_REPLICATED = ("norm.weight", "layernorm.weight", "mlp.gate.weight", "e_score_correction_bias")


@st.composite
def configs(draw: st.DrawFn, spec: ModelSpec) -> SourceConfig:
    d = spec.dims
    tps = [t for t in (1, 2, 4) if d.heads % t == 0 and d.intermediate % t == 0
           and (d.mla or d.kv_heads % t == 0 or t % d.kv_heads == 0)
           and (not d.mla or (d.q_lora_rank % t == 0 and (d.kv_lora_rank +
                                                             d.qk_rope_head_dim) % t == 0))
           and (d.shared_intermediate % t == 0)]
    tp, dp = draw(st.sampled_from(tps)), draw(st.integers(1, 2))
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if (tp * dp) % e == 0 and
                               (not d.moe_layers or d.num_experts % e == 0)]))
    etp = draw(st.sampled_from([x for x in (1, 2, 4) if (tp * dp) % (x * ep) == 0 and
                                (not d.moe_layers or d.moe_intermediate % x == 0)]))
    pp = draw(st.sampled_from([p for p in (1, 2, 3) if d.num_layers % p == 0]))
    return cfg(tp=tp, dp=dp, pp=pp, ep=ep, etp=etp, transformer_engine=draw(st.booleans()),
               expert_layout=draw(st.sampled_from(["grouped", "sequential"])))


@settings(deadline=None)  # a loaded machine: no wall-time assertion
@given(st.data())
def test_every_element_once_per_replica(data):
    """Per replica, each logical element (padding excluded) is held exactly m times.

    Replica: expert tensors (`mlp.experts.{e}.*`) belong to the rank's expert-DP index
    (experts are replicated over EDP = tp*dp/(etp*ep) ranks, not over DP); all others to
    its DP index. m = 1 for sharded tensors; m = the ranks of the TP group for the tensors
    Megatron replicates over TP (norms, router, expert bias, and the MLA down projections
    under TE); a tied embedding held again by the last PP stage counts once more.
    """
    spec = data.draw(tiny_specs())
    c = data.draw(configs(spec))
    lay = megatron.layout(spec, c)
    edp = c.tp * c.dp // (c.expert_tp * c.ep)

    def group(rl, pt, tensor):
        if ".mlp.experts." in tensor:
            return (rl.rank // (c.expert_tp * c.ep)) % edp
        return rl.replica

    counts = coverage(spec, lay, group)
    d = spec.dims
    for t in spec.tensors:
        if t.mtp:
            assert all(name != t.name for _, name in counts)
            continue
        m = 1
        if t.name.endswith(_REPLICATED) or (c.transformer_engine and d.mla and t.name.endswith(
                ("q_a_proj.weight", "kv_a_proj_with_mqa.weight"))):
            m = c.tp
        if t.name == "model.embed_tokens.weight" and d.tied and c.pp > 1:
            m = 2
        for g in range(edp if ".mlp.experts." in t.name else c.dp):
            held = counts[g, t.name]
            assert held.min() == held.max() == m, (t.name, g, held.min(), held.max(), m, c)
