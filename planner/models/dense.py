"""llama, qwen2, qwen3: dense decoders with GQA attention and a gated MLP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from planner.models.base import LogicalTensor, ModelDims, require


def dims(hf: dict[str, Any]) -> ModelDims:
    heads = require(hf, "num_attention_heads")
    hidden = require(hf, "hidden_size")
    return ModelDims(
        model_type=hf["model_type"],
        num_layers=require(hf, "num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or (hidden // heads if heads > 0 else 0),
        intermediate=require(hf, "intermediate_size"),
        vocab=require(hf, "vocab_size"),
        tied=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=hf["model_type"] == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=hf["model_type"] in ("qwen3", "qwen3_moe"),
    )


def attention(d: ModelDims, p: str, dtype: str, layer: int) -> Iterator[LogicalTensor]:
    """GQA attention of one layer (`p` ends with `self_attn.`)."""
    h, hd = d.hidden, d.head_dim
    yield LogicalTensor(p + "q_proj.weight", (d.heads * hd, h), dtype, layer)
    if d.qkv_bias:
        yield LogicalTensor(p + "q_proj.bias", (d.heads * hd,), dtype, layer)
    yield LogicalTensor(p + "k_proj.weight", (d.kv_heads * hd, h), dtype, layer)
    if d.qkv_bias:
        yield LogicalTensor(p + "k_proj.bias", (d.kv_heads * hd,), dtype, layer)
    yield LogicalTensor(p + "v_proj.weight", (d.kv_heads * hd, h), dtype, layer)
    if d.qkv_bias:
        yield LogicalTensor(p + "v_proj.bias", (d.kv_heads * hd,), dtype, layer)
    yield LogicalTensor(p + "o_proj.weight", (h, d.heads * hd), dtype, layer)
    if d.qk_norm:
        yield LogicalTensor(p + "q_norm.weight", (hd,), dtype, layer)
        yield LogicalTensor(p + "k_norm.weight", (hd,), dtype, layer)


def gated_mlp(p: str, hidden: int, inter: int, dtype: str, layer: int,
              mtp: bool = False) -> Iterator[LogicalTensor]:
    """gate/up/down projections (`p` ends with `mlp.` or `experts.{e}.`)."""
    yield LogicalTensor(p + "gate_proj.weight", (inter, hidden), dtype, layer, mtp=mtp)
    yield LogicalTensor(p + "up_proj.weight", (inter, hidden), dtype, layer, mtp=mtp)
    yield LogicalTensor(p + "down_proj.weight", (hidden, inter), dtype, layer, mtp=mtp)


def embeddings_head(d: ModelDims, dtype: str, body: Iterator[LogicalTensor]
                    ) -> Iterator[LogicalTensor]:
    """embed_tokens, the layers, the final norm and (untied) lm_head, in checkpoint order."""
    yield LogicalTensor("model.embed_tokens.weight", (d.vocab, d.hidden), dtype)
    yield from body
    yield LogicalTensor("model.norm.weight", (d.hidden,), dtype)
    if not d.tied:
        yield LogicalTensor("lm_head.weight", (d.vocab, d.hidden), dtype)


def tensors(d: ModelDims, dtype: str) -> Iterator[LogicalTensor]:
    def body() -> Iterator[LogicalTensor]:
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            yield LogicalTensor(p + "input_layernorm.weight", (d.hidden,), dtype, i)
            yield from attention(d, p + "self_attn.", dtype, i)
            yield LogicalTensor(p + "post_attention_layernorm.weight", (d.hidden,), dtype, i)
            yield from gated_mlp(p + "mlp.", d.hidden, d.intermediate, dtype, i)

    return embeddings_head(d, dtype, body())
