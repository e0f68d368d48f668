"""Tiny HF configs and hypothesis strategies for the source-layout tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from planner.spec import ModelSpec, spec_from_hf


def qwen3(**kw: Any) -> dict[str, Any]:
    return dict(model_type="qwen3", hidden_size=16, intermediate_size=32,
                num_attention_heads=8, num_key_value_heads=2, head_dim=4,
                num_hidden_layers=2, vocab_size=100, tie_word_embeddings=False) | kw


def qwen3_moe(**kw: Any) -> dict[str, Any]:
    return qwen3(model_type="qwen3_moe", moe_intermediate_size=8, num_experts=4,
                 num_experts_per_tok=2) | kw


def deepseek_v3(**kw: Any) -> dict[str, Any]:
    return dict(model_type="deepseek_v3", hidden_size=16, intermediate_size=32,
                moe_intermediate_size=8, n_routed_experts=4, n_shared_experts=1,
                num_experts_per_tok=2, num_attention_heads=4, q_lora_rank=8, kv_lora_rank=8,
                qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, num_hidden_layers=3,
                first_k_dense_replace=1, vocab_size=100, num_nextn_predict_layers=1) | kw


# Small models whose shards stay on the 128-grid of block FP8 under tensor parallelism 2
# and 4: a Qwen3-8B shape (head_dim 128, GQA 4/2) and a DeepSeek-V3 shape (MLA with
# 128-multiple ranks; 4 heads of 128+64 give q_b rows of 384 = 3 blocks per TP-2 rank).
FP8_QWEN = dict(model_type="qwen3", hidden_size=256, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, intermediate_size=512, vocab_size=300,
                num_hidden_layers=2, tie_word_embeddings=False, torch_dtype="bfloat16")
FP8_DSV3 = dict(model_type="deepseek_v3", hidden_size=256, num_attention_heads=4,
                num_key_value_heads=4, intermediate_size=256, moe_intermediate_size=256,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=300,
                num_hidden_layers=2, num_nextn_predict_layers=0, torch_dtype="bfloat16")

@st.composite
def tiny_specs(draw: st.DrawFn) -> ModelSpec:
    """A random small qwen3 / qwen3_moe / deepseek_v3 spec (uneven sizes on purpose)."""
    family = draw(st.sampled_from(["qwen3", "qwen3_moe", "deepseek_v3"]))
    layers = draw(st.integers(1, 4))
    vocab = draw(st.integers(5, 300))
    tied = draw(st.booleans())
    if family == "deepseek_v3":
        heads = draw(st.sampled_from([2, 4, 8]))
        hf = deepseek_v3(num_hidden_layers=layers, vocab_size=vocab, num_attention_heads=heads,
                         first_k_dense_replace=draw(st.integers(0, layers)),
                         n_routed_experts=draw(st.sampled_from([2, 4, 6, 8])),
                         q_lora_rank=draw(st.sampled_from([0, 8, 12])),
                         tie_word_embeddings=tied)
        return spec_from_hf(hf)
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3, 4]))
    hf = qwen3(num_hidden_layers=layers, vocab_size=vocab, num_attention_heads=heads,
               num_key_value_heads=kv, head_dim=draw(st.sampled_from([2, 4, 6])),
               intermediate_size=draw(st.sampled_from([12, 24, 48])), tie_word_embeddings=tied)
    if family == "qwen3_moe":
        hf = qwen3_moe(**{k: v for k, v in hf.items() if k != "model_type"},
                       num_experts=draw(st.sampled_from([2, 4, 6, 8])),
                       moe_intermediate_size=draw(st.sampled_from([4, 6, 8])),
                       mlp_only_layers=draw(st.lists(st.integers(0, layers - 1), max_size=1)))
    return spec_from_hf(hf)
