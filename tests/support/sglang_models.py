"""Tiny HF configs that real SGLang 0.5.23 builds on CPU, shared by its layout oracle
(tests/oracles/test_sglang_oracle.py) and the update tests (tests/integrations)."""

from __future__ import annotations

BASE = dict(hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_theta=10000.0, torch_dtype="float32", num_hidden_layers=2, hidden_size=128,
            vocab_size=1100)  # 1100 pads to 1152 (vocab padding on every rank)


def deepseek_v3(**kw: object) -> dict:
    # MLA with q_lora; layer 0 dense, layer 1 MoE with E=8 + 1 shared expert. SGLang's CPU
    # rotary embedding only implements DeepSeek YaRN, hence the (neutral) rope_scaling.
    return BASE | dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                       num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                       kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                       v_head_dim=32, intermediate_size=192, moe_intermediate_size=48,
                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                       first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1,
                       topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                       routed_scaling_factor=1.0, num_nextn_predict_layers=0,
                       tie_word_embeddings=False,
                       rope_scaling={"type": "yarn", "factor": 1.0, "beta_fast": 32,
                                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 256}) | kw
