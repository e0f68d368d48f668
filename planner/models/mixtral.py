"""mixtral: Mistral attention (GQA, no bias, no qk norm) and a sparse MoE block in every
layer, named as in checkpoints: `block_sparse_moe.gate` (the router) and
`block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down). No shared expert, no
dense MLP: `intermediate_size` is each expert's size."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from planner.models import dense
from planner.models.base import LogicalTensor, ModelDims, require

EXPERT_NAMES = ("w1", "w3", "w2")


def dims(hf: dict[str, Any]) -> ModelDims:
    base = dense.dims({**hf, "model_type": "mixtral"})
    experts = require(hf, "num_local_experts")
    return replace(base, intermediate=0, num_experts=experts,
                   moe_intermediate=base.intermediate, top_k=hf.get("num_experts_per_tok", 0),
                   moe_layers=tuple(range(base.num_layers)) if experts else (),
                   moe_module="block_sparse_moe", expert_names=EXPERT_NAMES)


def tensors(d: ModelDims, dtype: str) -> Iterator[LogicalTensor]:
    def body() -> Iterator[LogicalTensor]:
        h = d.hidden
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            yield LogicalTensor(p + "input_layernorm.weight", (h,), dtype, i)
            yield from dense.attention(d, p + "self_attn.", dtype, i)
            yield LogicalTensor(p + "post_attention_layernorm.weight", (h,), dtype, i)
            moe = p + "block_sparse_moe."
            yield LogicalTensor(moe + "gate.weight", (d.num_experts, h), dtype, i)
            for e in range(d.num_experts):
                w1, w3, w2 = (f"{moe}experts.{e}.{n}.weight" for n in EXPERT_NAMES)
                yield LogicalTensor(w1, (d.moe_intermediate, h), dtype, i)
                yield LogicalTensor(w3, (d.moe_intermediate, h), dtype, i)
                yield LogicalTensor(w2, (h, d.moe_intermediate), dtype, i)

    return dense.embeddings_head(d, dtype, body())
