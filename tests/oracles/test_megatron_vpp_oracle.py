"""Oracle: our Megatron virtual-pipeline layout against real Megatron-Core 0.16.1 on CPU.

Each case runs `megatron_vpp_worker.py` in `world` processes (gloo): per rank, the real
model chunks' names and shapes (prefixed `model{v}.`), the global layers Megatron gives
each chunk (`layer_number`), and the HF logits after loading our shards (to 1e-4).
"""

from __future__ import annotations

import pytest

from planner.layouts.megatron import chunk_layers
from schemas.config import ConfigError, SourceConfig
from tests.support import oracles

DENSE = dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_attention_heads=8,
             num_key_value_heads=2, head_dim=8, num_hidden_layers=4, vocab_size=100,
             tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)


def _chunks(layers: int, **kw) -> list[list[list[int]]]:
    cfg = SourceConfig(framework="megatron", **kw)
    return [[list(r) for r in stage] for stage in chunk_layers(layers, cfg)]


def test_chunk_layers_table():
    # Megatron's own examples (transformer_block.get_num_layers_to_build's comment)
    assert _chunks(8, pp=2, vpp=4) == [[[0], [2], [4], [6]], [[1], [3], [5], [7]]]
    assert _chunks(8, pp=2, vpp=2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    # uneven: first stage 2 layers (1 per chunk), the last 4 (2 per chunk)
    assert _chunks(6, pp=2, vpp=2, pp_first_stage_layers=2) == [[[0], [3]], [[1, 2], [4, 5]]]
    assert _chunks(4, pp=2) == [[[0, 1]], [[2, 3]]]  # no VPP: one chunk per stage


@pytest.mark.parametrize("layers, kw, message", [
    (4, dict(pp=1, vpp=2), "source.vpp: 2 needs source.pp >= 2"),
    (4, dict(pp=2, vpp=3), "source.vpp: 3 does not divide the 2 layers of PP stage 0"),
    (8, dict(pp=2, vpp=2, pp_first_stage_layers=3), "does not divide the 3 layers"),
])
def test_chunk_layers_refuses(layers, kw, message):
    with pytest.raises(ConfigError, match=message):
        chunk_layers(layers, SourceConfig(framework="megatron", **kw))


@pytest.mark.oracle
@pytest.mark.parametrize("hf, source, world", [
    pytest.param(DENSE, dict(tp=2, pp=2, vpp=2), 4, id="tp2-pp2-vpp2"),
    # uneven first stage (2 layers: 1 per chunk, the last stage 4: 2 per chunk), tied
    pytest.param(dict(DENSE, num_hidden_layers=6, tie_word_embeddings=True),
                 dict(pp=2, vpp=2, pp_first_stage_layers=2), 2, id="pp2-vpp2-uneven-tied"),
])
def test_vpp_matches_real_megatron(hf, source, world):
    oracles.require("megatron")
    oracles.require("transformers")
    from tests.oracles.launch import launch

    launch("megatron_vpp_worker.py", world, {"hf": hf, "source": source}, quiet_s=60)
