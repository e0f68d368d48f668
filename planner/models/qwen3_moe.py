"""qwen3_moe: Qwen3 attention, routed experts (no shared expert), a router per MoE layer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from planner.models import dense
from planner.models.base import LogicalTensor, ModelDims, require
from schemas.config import ConfigError


def dims(hf: dict[str, Any]) -> ModelDims:
    base = dense.dims({**hf, "intermediate_size": hf.get("intermediate_size", 0)})
    num_experts = require(hf, "num_experts")
    step = hf.get("decoder_sparse_step", 1) or 1
    mlp_only = hf.get("mlp_only_layers", []) or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise ConfigError("model.config: mlp_only_layers must be a list of layer indices; "
                          "fix config.json")
    mlp_only = set(mlp_only)
    moe = tuple(i for i in range(base.num_layers)
                if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0)
    return replace(base, num_experts=num_experts,
                   moe_intermediate=require(hf, "moe_intermediate_size"),
                   top_k=hf.get("num_experts_per_tok", 0), moe_layers=moe)


def tensors(d: ModelDims, dtype: str) -> Iterator[LogicalTensor]:
    def body() -> Iterator[LogicalTensor]:
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            yield LogicalTensor(p + "input_layernorm.weight", (d.hidden,), dtype, i)
            yield from dense.attention(d, p + "self_attn.", dtype, i)
            yield LogicalTensor(p + "post_attention_layernorm.weight", (d.hidden,), dtype, i)
            if d.is_moe(i):
                yield LogicalTensor(p + "mlp.gate.weight", (d.num_experts, d.hidden), dtype, i)
                for e in range(d.num_experts):
                    yield from dense.gated_mlp(f"{p}mlp.experts.{e}.", d.hidden,
                                               d.moe_intermediate, dtype, i)
            else:
                yield from dense.gated_mlp(p + "mlp.", d.hidden, d.intermediate, dtype, i)

    return dense.embeddings_head(d, dtype, body())
