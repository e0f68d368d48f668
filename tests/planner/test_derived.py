"""The header's `derived` list (planner/derived.py): which target tensors each rank must
re-derive after an update. DeepSeek-V3-shaped block-FP8 targets list MLA's W_UK_T/W_UV
(dequantized copies of `kv_b_proj`) on every rank that holds the layer; bf16 targets (where
vLLM keeps them views of `kv_b_proj`) and models without MLA list nothing."""

from __future__ import annotations

import pytest

from planner.compiler import compile_config
from planner.spec import spec_from_hf
from schemas.config import ClusterConfig, Config, ModelConfig, Options, SourceConfig, TargetConfig
from schemas.header import PlanHeader

MLA = dict(model_type="deepseek_v3", hidden_size=256, vocab_size=300, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128,
           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=256,
           moe_intermediate_size=256, n_routed_experts=4, n_shared_experts=1,
           num_experts_per_tok=2, first_k_dense_replace=3, tie_word_embeddings=False)
QWEN3 = dict(model_type="qwen3", hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
             head_dim=128, intermediate_size=512, vocab_size=101, num_hidden_layers=2,
             tie_word_embeddings=False)


def header(hf: dict, dtype: str, **target) -> PlanHeader:
    cfg = Config(model=ModelConfig("unused"), source=SourceConfig("fsdp2", dp=2),
                 target=TargetConfig("vllm", dtype=dtype, **target),
                 cluster=ClusterConfig(gpus_per_host=8, nics_per_host=2), options=Options())
    return compile_config(cfg, spec_from_hf(hf, mtp=False)).header


def test_fp8_mla_lists_w_uk_t_and_w_uv_per_rank_and_layer() -> None:
    h = header(MLA, "fp8_block128", tp=2, pp=3)  # 3 layers, one per PP stage
    d = h.derived
    assert len(d) == h.world == 2 + 6 and d[:2] == ((), ())
    for i, entries in enumerate(d[2:]):
        layer = (i // 2) % 3  # local = p*tp + t
        p = f"model.layers.{layer}.self_attn"
        assert list(entries) == [{"rule": "mla_absorb", "engine": "vllm", "module": p,
                            "reads": [p + ".kv_b_proj.weight", p + ".kv_b_proj.weight_scale_inv"],
                            "writes": ["W_UK_T", "W_UV"]}], (i, entries)


@pytest.mark.parametrize("hf,dtype", [(MLA, "bfloat16"), (QWEN3, "fp8_block128"),
                                      (QWEN3, "bfloat16")])
def test_nothing_to_refresh(hf: dict, dtype: str) -> None:
    d = header(hf, dtype, tp=2).derived
    assert d == ((),) * len(d)
