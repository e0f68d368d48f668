"""Tiny HF configs that real SGLang 0.5.23 builds on CPU, shared by its layout oracle
(tests/oracles/test_sglang_oracle.py) and the update tests (tests/integrations)."""

from __future__ import annotations

from typing import Any

from tests.support import engine_models

BASE = dict(engine_models.BASE, num_hidden_layers=2)
"""vLLM's tiny base with two layers; vocab 1100 pads to 1152 (padding on every rank)."""


def deepseek_v3(**kw: Any) -> dict[str, Any]:
    # vLLM's tiny DeepSeek-V3 (MLA with q_lora; layer 0 dense, layer 1 MoE with E=8 + 1
    # shared expert) with 4 heads, 2 layers and a neutral YaRN rope_scaling: SGLang's CPU
    # rotary embedding only implements DeepSeek YaRN
    return engine_models.deepseek_v3(**{
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "rope_scaling": {"type": "yarn", "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 256}, **kw})
