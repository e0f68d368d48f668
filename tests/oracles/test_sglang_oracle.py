"""Oracle: real SGLang 0.5.23 on CPU against `planner.layouts.sglang` (bit-exact per rank).

Each launch runs `world` processes of `sglang_worker.py` over gloo; every process builds
SGLang's model for its TP rank once per case (SGLang's own parallel groups and `get_model`,
then `load_weights` of random HF tensors) and compares all `named_parameters()` with
`materialize(layout, full)`: names, order, shapes, dtypes and values. A negative control
(a swapped KV head) runs in the same launch and must be caught. Install SGLang with
`tests/oracles/install_sglang.sh` (a private folder; torch and the rest untouched).
"""

from __future__ import annotations

import pytest

from tests.oracles.launch import launch
from tests.support import engine_models, oracles
from tests.support.engine_models import two_layers
from tests.support.sglang_models import deepseek_v3

pytestmark = pytest.mark.oracle
oracles.require("sglang")


qwen3 = two_layers(engine_models.qwen3)


def qwen3_moe(**kw: object) -> dict:
    # nh=4, ng=2
    return two_layers(engine_models.qwen3_moe)(**{"num_attention_heads": 4,
                                                  "num_key_value_heads": 2, **kw})


def case(name: str, hf: dict, tp: int, **kw: object) -> dict:
    return dict(name=name, hf=hf, tp=tp, **kw)


# One launch per world size; every case's engine spans the launch (tp * pp == world).
LAUNCHES = {
    2: [case("qwen3 tp2 tied", qwen3(tie_word_embeddings=True), 2),
        case("qwen3_moe tp2", qwen3_moe(), 2),
        case("qwen3_moe ep2", qwen3_moe(), 2, ep=True),
        case("deepseek_v3 tp2", deepseek_v3(), 2),
        case("qwen3 tp2 dp-attention", qwen3(), 2, dp=2, dp_attention=True),
        # PP 2: 3 layers split [1, 2] (remainder last); tied lm_head copied on the last
        # stage; SGLang's Qwen3-MoE holds lm_head on every stage; DeepSeek first/last
        case("qwen3 pp2 tied", qwen3(tie_word_embeddings=True, num_hidden_layers=3), 1, pp=2),
        case("qwen3_moe pp2", qwen3_moe(num_hidden_layers=3), 1, pp=2),
        case("deepseek_v3 pp2", deepseek_v3(num_hidden_layers=3), 1, pp=2),
        # negative control: SGLang loads k_proj with KV heads 0 and 1 swapped; this case
        # passes only if the comparison above reports the qkv_proj values as different
        case("qwen3 tp2 swapped kv (must be caught)", qwen3(), 2, swap_kv=True)],
    4: [case("qwen3 tp4 kv-replication", qwen3(), 4),
        # attention TP 2: the embedding is split over the attention group, not replicated
        case("qwen3 tp4 dp2 dp-attention", qwen3(), 4, dp=2, dp_attention=True),
        case("qwen3 tp4 dp2 dp-attention tied", qwen3(tie_word_embeddings=True), 4, dp=2,
             dp_attention=True)],
}


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_sglang_matches_layout(world: int) -> None:
    launch("sglang_worker.py", world, {"cases": LAUNCHES[world]}, quiet_s=120.0)
