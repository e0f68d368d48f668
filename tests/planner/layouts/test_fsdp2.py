"""FSDP2 source layout: hand-computed shards (torch.chunk rule), then a coverage property.

A piece is written (logical tensor, logical offsets, sizes, position in the physical one).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.layouts import fsdp2
from planner.spec import spec_from_hf
from schemas.config import ConfigError, SourceConfig
from tests.support.coverage import coverage
from tests.support.models import deepseek_v3, qwen3, qwen3_moe, tiny_specs


def cfg(**kw: object) -> SourceConfig:
    return SourceConfig(framework="fsdp2", **kw)


def tensors(layout, rank: int) -> dict:
    return {t.name: t for t in layout.ranks[rank].tensors}


def geo(pt) -> list[tuple]:
    return [(p.offsets, p.sizes, p.at) for p in pt.pieces]


def test_uneven_shard0_chunk_rule():
    # q_norm [hd=4] over 3 ranks: chunk ceil(4/3)=2 -> rows 0-1, 2-3, and an empty shard.
    lay = fsdp2.layout(spec_from_hf(qwen3()), cfg(dp=3))
    name = "model.layers.0.self_attn.q_norm.weight"
    assert [tensors(lay, r)[name].shape for r in range(3)] == [(2,), (2,), (0,)]
    assert geo(tensors(lay, 1)[name]) == [((2,), (2,), (0,))]
    assert tensors(lay, 2)[name].pieces == ()
    # embed_tokens [100, 16]: chunk 34 -> 34, 34, 32 rows; rank 2 = rows 68..99.
    emb = tensors(lay, 2)["model.embed_tokens.weight"]
    assert emb.shape == (32, 16) and geo(emb) == [((68, 0), (32, 16), (0, 0))]


def test_fsdp2_with_tp():
    # tp=2, dp=3, rank = tp + 2*dp. o_proj [16, 32] rowwise (TP dim 1): TP rank 1 holds
    # columns 16..31; FSDP chunks its 16 rows 6, 6, 4. Rank 3 = tp 1, dp 1: rows 6..11.
    lay = fsdp2.layout(spec_from_hf(qwen3()), cfg(tp=2, dp=3))
    o = tensors(lay, 3)["model.layers.0.self_attn.o_proj.weight"]
    assert o.shape == (6, 16) and geo(o) == [((6, 16), (6, 16), (0, 0))]
    # q_proj [32, 16] colwise (TP dim 0): TP rank 1 = rows 16..31, chunked 6, 6, 4;
    # rank 5 = tp 1, dp 2: rows 28..31.
    q = tensors(lay, 5)["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (4, 16) and geo(q) == [((28, 0), (4, 16), (0, 0))]
    # norms are replicated by TP, then sharded by FSDP: rank 1 (tp 1, dp 0) = rows 0..5.
    norm = tensors(lay, 1)["model.norm.weight"]
    assert geo(norm) == [((0,), (6,), (0,))]
    # embed_tokens: vocab split by TP (50 rows each), then FSDP: rank 4 = rows 0+34..49.
    emb = tensors(lay, 4)["model.embed_tokens.weight"]
    assert geo(emb) == [((34, 0), (16, 16), (0, 0))]


def test_hsdp_replicas_repeat_the_shards():
    lay = fsdp2.layout(spec_from_hf(qwen3()), cfg(dp=2, dp_replicate=2))
    assert [r.replica for r in lay.ranks] == [0, 0, 1, 1] and lay.replicas == 2
    assert lay.ranks[3].tensors == lay.ranks[1].tensors


def test_fused_experts():
    # E=4 experts over dp=3: chunk 2 -> experts 0-1, 2-3, none. gate_up_proj [E, 2I, H]
    # per expert [gate; up] (I=8): rank 1 holds experts 2, 3.
    spec = spec_from_hf(qwen3_moe(num_hidden_layers=1))
    lay = fsdp2.layout(spec, cfg(dp=3, fused_experts=True))
    gu = tensors(lay, 1)["model.layers.0.mlp.experts.gate_up_proj"]
    assert gu.shape == (2, 16, 16)
    assert [(p.tensor.split(".")[-3] + "." + p.tensor.split(".")[-2], p.at)
            for p in gu.pieces] == [("2.gate_proj", (0, 0, 0)), ("2.up_proj", (0, 8, 0)),
                                    ("3.gate_proj", (1, 0, 0)), ("3.up_proj", (1, 8, 0))]
    down = tensors(lay, 2)["model.layers.0.mlp.experts.down_proj"]
    assert down.shape == (0, 16, 8) and down.pieces == ()
    names = [t.name for t in lay.ranks[0].tensors]
    assert names.index("model.layers.0.mlp.experts.down_proj") < names.index(
        "model.layers.0.mlp.gate.weight")  # transformers 5.x: experts before gate


def test_deepseek_buffers_whole_and_last():
    spec = spec_from_hf(deepseek_v3(num_hidden_layers=2))
    lay = fsdp2.layout(spec, cfg(dp=4, dtype="bfloat16"))
    last = lay.ranks[3].tensors[-1]
    assert last.name == "model.layers.1.mlp.gate.e_score_correction_bias"
    assert last.shape == (4,) and last.dtype == "float32"
    assert all(".layers.2." not in t.name for t in lay.ranks[0].tensors)  # MTP is not in HF
    assert lay.ranks[0].tensors[0].dtype == "bfloat16"


@pytest.mark.parametrize("hf, kw, key", [
    (qwen3_moe(), dict(tp=2, fused_experts=True), "source.fused_experts"),
    (qwen3(), dict(tp=3), "source.tp"),
    (qwen3(), dict(tp=4), "source.tp"),  # 2 kv heads
])
def test_impossible_configs(hf, kw, key):
    with pytest.raises(ConfigError, match=key):
        fsdp2.layout(spec_from_hf(hf), cfg(**kw))


_TP_REPLICATED = ("norm.weight", "layernorm.weight", "mlp.gate.weight", "q_a_proj.weight",
                  "kv_a_proj_with_mqa.weight")


@settings(deadline=None)  # a loaded machine: no wall-time assertion
@given(st.data())
def test_every_element_once_per_replica(data):
    """Per replica (HSDP `dp_replicate` index), each logical element is held exactly m
    times: m = 1 for parameters TP shards, tp for those TP replicates (norms, router,
    MLA a-projections; FSDP still shards them), tp*dp for buffers (never sharded)."""
    spec = data.draw(tiny_specs())
    d = spec.dims
    tp = data.draw(st.sampled_from([t for t in (1, 2, 4) if d.heads % t == 0 and
                                    (d.mla or d.kv_heads % t == 0)]))
    c = cfg(tp=tp, dp=data.draw(st.integers(1, 5)), dp_replicate=data.draw(st.integers(1, 2)),
            fused_experts=tp == 1 and data.draw(st.booleans()))
    lay = fsdp2.layout(spec, c)
    counts = coverage(spec, lay, lambda rl, pt, tensor: rl.replica)
    for t in spec.tensors:
        if t.mtp or t.name == "lm_head.weight" and d.tied:
            continue
        m = c.tp * c.dp if t.buffer else c.tp if t.name.endswith(_TP_REPLICATED) else 1
        for g in range(c.dp_replicate):
            held = counts[g, t.name]
            assert held.min() == held.max() == m, (t.name, g, held.min(), held.max(), m, c)
