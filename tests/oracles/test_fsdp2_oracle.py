"""Oracle: our FSDP2 layout against torch's own DTensor sharding.

1. Pure: every parameter's local box on every rank equals torch's
   `_compute_local_shape_and_global_offset` for the placements FSDP2 gives it
   (`Shard(0)` on the dp mesh dim; with TP `Shard(1)` or, for a TP cut on dim 0,
   FSDP2's `_StridedShard(0, split_factor=tp)`), uneven sizes included.
2. Real: the HF model (transformers) with torchtitan-style TP and `fully_shard` on gloo in
   spawned processes (`fsdp2_worker.py`): names, order, local shapes and values.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.tensor._utils import (  # noqa: E402
    _compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard  # noqa: E402

from planner.layouts import fsdp2  # noqa: E402
from planner.spec import spec_from_hf  # noqa: E402
from schemas.config import SourceConfig  # noqa: E402
from tests.oracles.launch import launch  # noqa: E402
from tests.support.models import deepseek_v3, qwen3  # noqa: E402

pytestmark = pytest.mark.oracle


def _placements(tp_dim: int | None, tp: int) -> list:
    if tp_dim is None:
        return [Shard(0), Replicate()]
    if tp_dim == 0:
        return [_StridedShard(0, split_factor=tp), Shard(0)]
    return [Shard(0), Shard(tp_dim)]


@pytest.mark.parametrize("hf", [qwen3(vocab_size=101, intermediate_size=30),
                                deepseek_v3(vocab_size=77)], ids=["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("tp, dp", [(1, 3), (1, 5), (2, 3), (2, 4), (4, 3)])
def test_local_boxes_match_dtensor(hf, tp, dp):
    spec = spec_from_hf(hf)
    if spec.dims.heads % tp or (not spec.dims.mla and spec.dims.kv_heads % tp):
        pytest.skip("tp does not divide the heads")
    cfg = SourceConfig(framework="fsdp2", tp=tp, dp=dp)
    lay = fsdp2.layout(spec, cfg)
    shapes = {t.name: t.shape for t in spec.tensors}
    checked = 0
    for rl in lay.ranks:
        t, d = rl.rank % tp, rl.rank // tp
        for pt in rl.tensors:
            if pt.name not in shapes or spec.by_name[pt.name].buffer:
                continue
            shape, offset = _compute_local_shape_and_global_offset(
                shapes[pt.name], (dp, tp), [d, t], _placements(fsdp2.tp_dim(pt.name), tp))
            assert pt.shape == tuple(shape), (pt.name, rl.rank)
            if 0 in shape:
                assert pt.pieces == ()
                continue
            (piece,) = pt.pieces
            assert (piece.offsets, piece.sizes, piece.at) == (
                tuple(offset), tuple(shape), (0,) * len(shape)), (pt.name, rl.rank)
            checked += 1
    assert checked > 0


DENSE = dict(model_type="qwen3", hidden_size=12, intermediate_size=20, num_attention_heads=4,
             num_key_value_heads=2, head_dim=4, num_hidden_layers=2, vocab_size=50,
             tie_word_embeddings=False)
MOE = dict(DENSE, model_type="qwen3_moe", moe_intermediate_size=6, num_experts=4,
           num_experts_per_tok=1)
GPT_OSS = dict(DENSE, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=1,
               attention_bias=True, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"])
MIXTRAL = dict(DENSE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=1)
GLM4_MOE = dict(DENSE, model_type="glm4_moe", attention_bias=True, use_qk_norm=True,
                moe_intermediate_size=6, n_routed_experts=4, n_shared_experts=1,
                num_experts_per_tok=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                num_nextn_predict_layers=1)


@pytest.mark.parametrize("hf, source, world", [
    # vocab 50 -> TP 25 rows -> FSDP 13 + 12; q_norm 4 -> 2 + 2
    pytest.param(DENSE, dict(tp=2, dp=2), 4, id="dense-tp2-dp2"),
    # 4 experts over 3 ranks: 2, 2, 0 (an empty shard); fused [E, 2I, H] with transformers
    # 5.x, checkpoint-named experts (each Shard(0) on its own rows) with 4.x
    pytest.param(MOE, dict(dp=3), 3, id="moe-dp3"),
    # transformers 5.x renames `block_sparse_moe` to `mlp` and fuses w1/w3 into gate_up_proj
    pytest.param(MIXTRAL, dict(dp=2), 2, id="mixtral-dp2"),
    # q/k/v biases, router bias buffer, shared expert; the MTP layer is not in the HF model
    pytest.param(GLM4_MOE, dict(dp=3), 3, id="glm4_moe-dp3"),
    # the checkpoint's fused experts are the HF model's parameters; sinks, biases
    pytest.param(GPT_OSS, dict(dp=3), 3, id="gpt_oss-dp3"),
])
def test_fsdp2_matches_real_dtensors(hf, source, world):
    transformers = pytest.importorskip("transformers")
    fused = (hf["model_type"] in ("qwen3_moe", "mixtral", "glm4_moe")
             and int(transformers.__version__.split(".")[0]) >= 5)
    launch("fsdp2_worker.py", world, {"hf": hf, "source": dict(source, fused_experts=fused)})
