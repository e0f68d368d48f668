"""Oracle: our Megatron layout against a real Megatron-Core 0.16.1 GPTModel on CPU.

Each case runs `megatron_worker.py` in `world` processes (gloo): the real model's
`named_parameters()` names and shapes per rank must equal ours, and after loading our
`materialize`d shards into it, its gathered logits must equal the HF model's (same
logical tensors, transformers on CPU, fp32) to 1e-4. DeepSeek-V3 (MLA) is compared by
names and shapes only.
"""

from __future__ import annotations

import pytest

from tests.support import oracles  # noqa: E402

oracles.require("megatron")
oracles.require("transformers")

from tests.oracles.launch import launch  # noqa: E402
from tests.support.models import deepseek_v3  # noqa: E402

pytestmark = pytest.mark.oracle

DENSE = dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_attention_heads=8,
             num_key_value_heads=2, head_dim=8, num_hidden_layers=2, vocab_size=100,
             tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
MOE = dict(DENSE, model_type="qwen3_moe", intermediate_size=48, moe_intermediate_size=16,
           num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])
# GLM-4.5: q/k/v biases, q/k norms, half the head dim rotary, dense layer 0, then sigmoid
# routing with the expert bias, a routed scaling factor and a shared expert
GLM4_MOE = dict(DENSE, model_type="glm4_moe", attention_bias=True, use_qk_norm=True,
                partial_rotary_factor=0.5, intermediate_size=48, moe_intermediate_size=16,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=2.5, num_nextn_predict_layers=0)


@pytest.mark.parametrize("hf, source, world", [
    pytest.param(DENSE, dict(tp=4), 4, id="dense-tp4-ng2"),  # cuts inside a kv group
    pytest.param(dict(DENSE, tie_word_embeddings=True), dict(pp=2), 2, id="tied-pp2"),
    pytest.param(MOE, dict(ep=2, dp=2, expert_layout="sequential"), 2, id="moe-ep2"),
    pytest.param(MOE, dict(tp=2, dp=2, ep=2, etp=2, expert_layout="sequential"), 4,
                 id="moe-tp2-ep2-etp2"),
    pytest.param(GLM4_MOE, dict(tp=2, dp=2, ep=2, etp=1, expert_layout="sequential"), 2,
                 id="glm4_moe-tp2-ep2"),
    # names and shapes only: MLA (local spec: down projections column-parallel), dense
    # first layer, shared experts, router.expert_bias; expert grid with etp 1 under tp 2
    pytest.param(deepseek_v3(num_hidden_layers=2), dict(tp=2, ep=2, etp=1,
                                                         expert_layout="sequential"), 2,
                 id="deepseek-mla-tp2-ep2-names"),
])
def test_megatron_matches_real_model(hf, source, world):
    launch("megatron_worker.py", world, {"hf": hf, "source": source})
