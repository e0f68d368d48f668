"""Specs from transformers (`planner.models.hf`): the spec of a model_type with no
hand-written family, and the hand-written families checked against it.

transformers builds the model on the meta device and reverts its fused experts to
checkpoint names with its own `revert_weight_conversion`; every hand-written family must
give the same tensors (names, shapes, dtypes, which are buffers) on small configs that
take each of its branches. MTP tensors are checkpoint-only (not in the HF model).
"""

from __future__ import annotations

import pytest

from planner.spec import ModelSpec, spec_from_hf
from schemas.config import ConfigError
from tests.support import models

pytest.importorskip("transformers")
from planner.models import hf as from_transformers  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_hidden_layers=3, vocab_size=200,
             tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(SMALL, model_type="llama"),
    "llama tied": dict(SMALL, model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(SMALL, model_type="qwen2"),
    "qwen3": dict(SMALL, model_type="qwen3"),
    "qwen3_moe": models.qwen3_moe(num_hidden_layers=3, decoder_sparse_step=1),
    "qwen3_moe mlp_only": models.qwen3_moe(num_hidden_layers=3, mlp_only_layers=[1],
                                           intermediate_size=48),
    "deepseek_v3": models.deepseek_v3(num_nextn_predict_layers=0),
    "deepseek_v3 no q_lora": models.deepseek_v3(q_lora_rank=None, first_k_dense_replace=0),
    "kimi_k2": models.deepseek_v3(model_type="kimi_k2", num_nextn_predict_layers=0),
    "mixtral": dict(SMALL, model_type="mixtral", num_local_experts=4),
    "glm4_moe": dict(SMALL, model_type="glm4_moe", attention_bias=True, use_qk_norm=True,
                     moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                     first_k_dense_replace=1, num_nextn_predict_layers=0),
    "glm4_moe no bias, no qk norm, 2 shared": dict(
        SMALL, model_type="glm4_moe", attention_bias=False, moe_intermediate_size=32,
        n_routed_experts=4, n_shared_experts=2, first_k_dense_replace=0),
    "gpt_oss": dict(SMALL, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


def _table(spec: ModelSpec) -> dict[str, tuple]:
    return {t.name: (t.shape, t.stored, t.dtype, t.buffer, t.layer) for t in spec.tensors
            if not t.mtp}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_hand_written_family_equals_transformers(name: str) -> None:
    hf = FAMILIES[name]
    hand = spec_from_hf(hf)
    dims = from_transformers.dims(hf)
    derived = ModelSpec(dims=dims, tensors=tuple(from_transformers.tensors(hf, dims,
                                                                           "bfloat16")))
    assert hand.dims.tied == dims.tied
    assert _table(hand) == _table(derived)
    assert hand.total_params == derived.total_params


def test_a_model_type_without_family_gets_its_spec_from_transformers() -> None:
    """Mixtral in transformers 5.x fuses its experts (`mlp.experts.gate_up_proj`); the spec
    has the checkpoint names `block_sparse_moe.experts.{e}.w1/w2/w3` and `gate`."""
    hf = dict(SMALL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    dims = from_transformers.dims(hf)
    spec = ModelSpec(dims=dims, tensors=tuple(from_transformers.tensors(hf, dims, "bfloat16")))
    names = [t.name for t in spec.tensors]
    p = "model.layers.2.block_sparse_moe."
    assert spec.by_name[p + "experts.3.w1.weight"].shape == (96, 64)
    assert spec.by_name[p + "experts.3.w3.weight"].shape == (96, 64)
    assert spec.by_name[p + "experts.3.w2.weight"].shape == (64, 96)
    assert spec.by_name[p + "gate.weight"].shape == (4, 64)
    assert not any(".mlp." in n or "gate_up_proj" in n for n in names)
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert [t.layer for t in spec.tensors if t.layer >= 0] == sorted(
        t.layer for t in spec.tensors if t.layer >= 0)
    # 3 layers x (4 experts x 3 + gate + 4 attention + 2 norms) + embed, norm, lm_head
    assert len(names) == 3 * 19 + 3


def test_spec_from_hf_falls_back_to_transformers_and_marks_buffers() -> None:
    """gpt2 has no family: its spec is transformers' (fused `c_attn`, `wpe`, tied head)."""
    spec = spec_from_hf(dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4,
                             n_positions=128, vocab_size=100))
    assert spec.dims.model_type == "gpt2" and spec.dims.hidden == 64 and spec.dims.tied
    assert spec.by_name["transformer.h.1.attn.c_attn.weight"].shape == (64, 192)
    assert spec.by_name["transformer.h.1.attn.c_attn.weight"].layer == 1
    assert "lm_head.weight" not in spec.by_name  # tied: written once
    ds = spec_from_hf(models.deepseek_v3(num_nextn_predict_layers=0))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    derived = from_transformers.state(models.deepseek_v3(), "bfloat16")
    assert derived[bias] == ((4,), "float32", True) and ds.by_name[bias].buffer


def test_unknown_model_type_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="'not_a_model' is not supported.*transformers "
                       "does not know it.*hand-written: llama"):
        spec_from_hf(dict(SMALL, model_type="not_a_model"))


def test_a_config_class_renamed_by_vllm_still_gives_checkpoint_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's config loader sets `model_type` on transformers' config class for an alias
    (kimi_k2 -> `DeepseekV3Config.model_type = "kimi_k2"`); transformers finds its expert
    conversion by model_type, so a spec built after a kimi_k2 trace kept fused experts."""
    from transformers import DeepseekV3Config

    monkeypatch.setattr(DeepseekV3Config, "model_type", "kimi_k2")
    hf = FAMILIES["deepseek_v3"]
    dims = from_transformers.dims(hf)
    derived = ModelSpec(dims=dims, tensors=tuple(from_transformers.tensors(hf, dims,
                                                                           "bfloat16")))
    assert _table(derived) == _table(spec_from_hf(hf))
