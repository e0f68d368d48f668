"""gpt_oss (gpt-oss-20b / 120b, the bf16 checkpoints): GQA attention with q/k/v/o biases
and a learned attention sink per head (`self_attn.sinks [heads]`), alternating sliding and
full attention (no tensor of its own), and in every layer a router with a bias and experts
stored fused as the checkpoint stores them: `mlp.experts.gate_up_proj [E, H, 2I]` (gate and
up interleaved along the last dim: gate at even columns, up at odd ones), its bias
`gate_up_proj_bias [E, 2I]`, `down_proj [E, I, H]` and `down_proj_bias [E, H]`. These fused
tensors are the logical tensors (the checkpoint names them so), viewed as 2-d (`stored`
keeps the checkpoint shape)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from planner.models import dense
from planner.models.base import LogicalTensor, ModelDims, as_2d, require


def dims(hf: dict[str, Any]) -> ModelDims:
    base = dense.dims({**hf, "model_type": "gpt_oss", "attention_bias": True})
    experts = require(hf, "num_local_experts")
    return replace(base, intermediate=0, num_experts=experts,
                   moe_intermediate=base.intermediate, top_k=hf.get("num_experts_per_tok", 0),
                   moe_layers=tuple(range(base.num_layers)) if experts else ())


def layer(d: ModelDims, i: int, dtype: str) -> Iterator[LogicalTensor]:
    p, h, e, inter = f"model.layers.{i}.", d.hidden, d.num_experts, d.moe_intermediate
    yield LogicalTensor(p + "input_layernorm.weight", (h,), dtype, i)
    yield LogicalTensor(p + "self_attn.sinks", (d.heads,), dtype, i)
    yield from dense.attention(d, p + "self_attn.", dtype, i)
    yield LogicalTensor(p + "self_attn.o_proj.bias", (h,), dtype, i)
    yield LogicalTensor(p + "post_attention_layernorm.weight", (h,), dtype, i)
    yield LogicalTensor(p + "mlp.router.weight", (e, h), dtype, i)
    yield LogicalTensor(p + "mlp.router.bias", (e,), dtype, i)
    x = p + "mlp.experts."
    yield as_2d(x + "gate_up_proj", (e, h, 2 * inter), dtype, i)  # viewed [E*H, 2I]
    yield LogicalTensor(x + "gate_up_proj_bias", (e, 2 * inter), dtype, i)
    yield as_2d(x + "down_proj", (e, inter, h), dtype, i)  # viewed [E*I, H]
    yield LogicalTensor(x + "down_proj_bias", (e, h), dtype, i)


def tensors(d: ModelDims, dtype: str) -> Iterator[LogicalTensor]:
    def body() -> Iterator[LogicalTensor]:
        for i in range(d.num_layers):
            yield from layer(d, i, dtype)

    return dense.embeddings_head(d, dtype, body())
