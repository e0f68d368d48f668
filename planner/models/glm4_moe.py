"""glm4_moe (GLM-4.5, GLM-4.6, GLM-4.5-Air): GQA attention with q/k/v biases
(`attention_bias`), optional q/k norms (`use_qk_norm`), partial rotary (no tensor of its
own), dense first layers (`first_k_dense_replace`), then routed experts with a sigmoid
router and its `e_score_correction_bias` (fp32 buffer) plus shared experts; and the MTP
layers the checkpoint carries after the decoder (DeepSeek-V3's MTP module: embed_tokens,
enorm, hnorm, eh_proj, shared_head, and a MoE decoder layer)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from planner.models import deepseek_v3, dense
from planner.models.base import LogicalTensor, ModelDims, require


def dims(hf: dict[str, Any]) -> ModelDims:
    base = dense.dims({**hf, "model_type": "glm4_moe"})
    layers = base.num_layers
    experts = hf.get("n_routed_experts") or 0
    first_dense = hf.get("first_k_dense_replace", 0) or 0
    mtp_layers = hf.get("num_nextn_predict_layers", 0) or 0
    moe = tuple(i for i in range(layers) if experts and i >= first_dense)
    if experts:  # the MTP layers after the decoder are MoE layers too
        moe += tuple(range(layers, layers + mtp_layers))
    moe_inter = require(hf, "moe_intermediate_size")
    return replace(base, qk_norm=bool(hf.get("use_qk_norm", False)), num_experts=experts,
                   moe_intermediate=moe_inter,
                   shared_intermediate=moe_inter * (hf.get("n_shared_experts") or 0),
                   top_k=hf.get("num_experts_per_tok", 0), moe_layers=moe,
                   mtp_layers=mtp_layers)


def layer(d: ModelDims, i: int, dtype: str, mtp: bool = False) -> Iterator[LogicalTensor]:
    p, h = f"model.layers.{i}.", d.hidden
    yield LogicalTensor(p + "input_layernorm.weight", (h,), dtype, i, mtp=mtp)
    for t in dense.attention(d, p + "self_attn.", dtype, i):
        yield replace(t, mtp=mtp)
    yield LogicalTensor(p + "post_attention_layernorm.weight", (h,), dtype, i, mtp=mtp)
    yield from deepseek_v3.mlp(d, p, dtype, i, mtp, moe=d.is_moe(i))


def tensors(d: ModelDims, dtype: str) -> Iterator[LogicalTensor]:
    return deepseek_v3.with_mtp(d, dtype, layer)
