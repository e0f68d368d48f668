"""Tiny HF configs that real vLLM 0.33 builds (all the keys its model classes read), one
per hand-written family. Vocab 1100 pads to 1152 = 2*576 = 3*384 = 4*288 (padding rows at
every TP size); the layer counts give PP 2 an uneven split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

BASE: dict[str, Any] = dict(hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-6,
                            rope_theta=10000.0, torch_dtype="float32", num_hidden_layers=3,
                            hidden_size=128, vocab_size=1100)


def two_layers(family: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`family`'s config with two layers, unless the caller names another count."""
    return lambda **kw: family(**{"num_hidden_layers": 2, **kw})


def llama(**kw: Any) -> dict[str, Any]:
    # nh=8, ng=2: TP 4 replicates each KV head on two ranks
    return BASE | dict(model_type="llama", architectures=["LlamaForCausalLM"],
                       num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                       intermediate_size=256, tie_word_embeddings=False,
                       attention_bias=False, mlp_bias=False) | kw


def qwen2(**kw: Any) -> dict[str, Any]:
    # qkv bias; nh=4, ng=4: TP 2 splits the KV heads
    return BASE | dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                       num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=256, tie_word_embeddings=False) | kw


def qwen3(**kw: Any) -> dict[str, Any]:
    # nh=4, ng=2: TP 4 replicates each KV head on two ranks
    return BASE | dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       intermediate_size=256, tie_word_embeddings=False) | kw


def qwen3_moe(**kw: Any) -> dict[str, Any]:
    # nh=6, ng=1 (TP 2 and 3 both valid); E=8 (EP 3: 3, 3, 2 experts)
    return BASE | dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                       num_attention_heads=6, num_key_value_heads=1, head_dim=64,
                       intermediate_size=192, moe_intermediate_size=64, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[], tie_word_embeddings=False) | kw


def deepseek_v3(**kw: Any) -> dict[str, Any]:
    # MLA with q_lora; layer 0 dense, layers 1-2 MoE with E=8 + 1 shared expert
    return BASE | dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                       num_attention_heads=6, num_key_value_heads=6, q_lora_rank=64,
                       kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                       v_head_dim=32, intermediate_size=192, moe_intermediate_size=48,
                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                       first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1,
                       topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                       routed_scaling_factor=1.0, num_nextn_predict_layers=0,
                       tie_word_embeddings=False, rope_scaling=None) | kw


def gemma3(**kw: Any) -> dict[str, Any]:
    # gemma3_text, no hand-written rules (spec from transformers, layout traced): q/k norms,
    # four norms per layer, sliding and full attention, tied embedding; nh=4, ng=2
    return BASE | dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       intermediate_size=256, hidden_activation="gelu_pytorch_tanh",
                       query_pre_attn_scalar=32, sliding_window=64,
                       rope_local_base_freq=10000.0, tie_word_embeddings=True,
                       layer_types=["sliding_attention", "sliding_attention",
                                    "full_attention"]) | kw
