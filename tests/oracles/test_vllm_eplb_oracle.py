"""Oracle: vLLM 0.33's own EPLB rearrangement on CPU against a refit with a replanned plan.

Two processes of `vllm_eplb_worker.py` over gloo (TP 2, EP 2, `enable_eplb`, 2 redundant
experts: 10 physical experts for 8 logical ones): vLLM loads the model in its initial
placement, moves the experts with `rearrange_expert_weights_inplace`, and every rank's
`named_parameters()` must equal, bit for bit, what the plan for each placement writes (the
second plan replanned from the first); the backend check must read the new placement from
the model and refuse the old plan in one line.
"""

from __future__ import annotations

import pytest

from tests.oracles.launch import launch
from tests.support import oracles

pytestmark = pytest.mark.oracle
oracles.require("vllm")

QWEN3_MOE = dict(hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-6,
                 rope_theta=10000.0, torch_dtype="float32", num_hidden_layers=2,
                 hidden_size=128, vocab_size=1100, model_type="qwen3_moe",
                 architectures=["Qwen3MoeForCausalLM"], num_attention_heads=6,
                 num_key_value_heads=1, head_dim=64, intermediate_size=192,
                 moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                 tie_word_embeddings=False)


def test_vllm_eplb_rearrangement_equals_the_replanned_refit() -> None:
    launch("vllm_eplb_worker.py", 2, {"hf": QWEN3_MOE, "redundant": 2}, quiet_s=60.0)
