"""Oracle: real vLLM 0.33.0 on CPU against `planner.layouts.vllm` (bit-exact per rank).

Each launch runs `world` processes of `vllm_worker.py` over gloo; every process builds the
engine's model for its rank once per case (`load_format="dummy"`, then `load_weights` of
random HF tensors) and compares all `named_parameters()` with `materialize(layout, full)`.
Install vLLM with `tests/oracles/install_vllm.sh` (no CUDA, torch untouched).
"""

from __future__ import annotations

import pytest

from tests.oracles.launch import launch
from tests.support import engine_models, oracles
from tests.support.engine_models import gemma3, two_layers

pytestmark = pytest.mark.oracle
oracles.require("vllm")  # without the 20 s import

BASE = dict(engine_models.BASE, num_hidden_layers=2)
"""The engine models' base with two layers (vocab 1100 pads to 1152 = 2*576 = 3*384 = 4*288)."""
qwen3, qwen3_moe, deepseek_v3 = (two_layers(f) for f in (
    engine_models.qwen3, engine_models.qwen3_moe, engine_models.deepseek_v3))


def mixtral(**kw: object) -> dict:
    # nh=4, ng=2; E=8 experts in every layer, named block_sparse_moe.experts.{e}.w1/w3/w2
    return BASE | dict(model_type="mixtral", architectures=["MixtralForCausalLM"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                       tie_word_embeddings=False, sliding_window=None) | kw


def glm4_moe(**kw: object) -> dict:
    # nh=6, ng=2 (TP 2: 3 q heads, 1 kv head per rank); q/k/v biases, q/k norms, partial
    # rotary; layer 0 dense, layer 1 MoE with E=8 + 1 shared expert and the router bias
    return BASE | dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"],
                       num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                       attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
                       intermediate_size=192, moe_intermediate_size=64, n_routed_experts=8,
                       n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                       n_group=1, topk_group=1, norm_topk_prob=True,
                       routed_scaling_factor=1.0, num_nextn_predict_layers=1,
                       tie_word_embeddings=False) | kw


def gpt_oss(**kw: object) -> dict:
    # nh=4, ng=2; sinks, q/k/v/o biases, router bias, fused interleaved gate_up_proj with
    # biases; sliding and full attention layers; E=8 (EP 2: 4 each)
    return BASE | dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                       experts_per_token=2, attention_bias=True, sliding_window=64,
                       layer_types=["sliding_attention", "full_attention"],
                       rope_theta=150000.0, swiglu_limit=7.0, tie_word_embeddings=False,
                       rope_scaling={"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 256}) | kw


def case(name: str, hf: dict, tp: int, ep: bool = False, pp: int = 1,
         layout: str = "rules") -> dict:
    """`layout: traced` compares with `planner/layouts/traced.py` (traced in the worker)."""
    return dict(name=name, hf=hf, tp=tp, ep=ep, pp=pp, layout=layout)


# One launch per world size; the cases of a launch share its processes. A case with
# tp*pp < world runs world/(tp*pp) copies of the engine (vLLM's external DP), each checked.
LAUNCHES = {
    2: [case("qwen3 tp1 tied", qwen3(tie_word_embeddings=True), 1),
        case("qwen3 tp2", qwen3(), 2),
        case("qwen3_moe tp2", qwen3_moe(), 2),
        case("qwen3_moe ep2", qwen3_moe(), 2, ep=True),
        case("deepseek_v3 tp2", deepseek_v3(), 2),
        case("deepseek_v3 ep2", deepseek_v3(), 2, ep=True),
        case("mixtral tp2", mixtral(), 2),
        case("mixtral ep2", mixtral(), 2, ep=True),
        case("glm4_moe tp2", glm4_moe(), 2),
        case("glm4_moe ep2", glm4_moe(), 2, ep=True),
        case("gpt_oss tp2", gpt_oss(), 2),
        case("gpt_oss ep2", gpt_oss(), 2, ep=True),
        # a family without hand-written rules: its traced layout against vLLM's parameters
        case("gemma3 tp2 traced", gemma3(torch_dtype="float32"), 2, layout="traced"),
        case("gemma3 pp2 traced", gemma3(torch_dtype="float32"), 1, pp=2, layout="traced"),
        # PP 2: 3 layers split [2, 1]; tied embedding on both stages; vLLM's Qwen3-MoE
        # keeps embed/norm/lm_head on every stage; DeepSeek first/last only.
        case("qwen3 pp2 tied", qwen3(tie_word_embeddings=True, num_hidden_layers=3), 1, pp=2),
        case("qwen3_moe pp2", qwen3_moe(), 1, pp=2),
        case("deepseek_v3 pp2", deepseek_v3(), 1, pp=2)],
    3: [case("qwen3_moe ep3", qwen3_moe(), 3, ep=True),
        case("deepseek_v3 ep3", deepseek_v3(), 3, ep=True),
        case("mixtral ep3 (3, 3, 2 experts)", mixtral(num_attention_heads=6,
                                                    num_key_value_heads=1), 3, ep=True)],
    4: [case("qwen3 tp4 kv-replication", qwen3(), 4),
        case("gemma3 tp4 kv-replication traced", gemma3(torch_dtype="float32"), 4,
             layout="traced")],
}


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_vllm_matches_layout(world: int) -> None:
    launch("vllm_worker.py", world, {"cases": LAUNCHES[world]}, quiet_s=60.0)
