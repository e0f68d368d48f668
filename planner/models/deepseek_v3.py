"""deepseek_v3 (and Kimi-K2): MLA attention, dense first layers, routed + shared experts,
`e_score_correction_bias` (fp32 buffer), and the MTP layers the checkpoint carries."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from planner.models import dense
from planner.models.base import LogicalTensor, ModelDims, require


def dims(hf: dict[str, Any]) -> ModelDims:
    layers = require(hf, "num_hidden_layers")
    first_dense = hf.get("first_k_dense_replace", 0) or 0
    freq = hf.get("moe_layer_freq", 1) or 1
    num_experts = hf.get("n_routed_experts") or 0
    mtp_layers = hf.get("num_nextn_predict_layers", 0) or 0
    moe = tuple(i for i in range(layers)
                if num_experts and i >= first_dense and i % freq == 0)
    if num_experts:  # the MTP layers after the decoder are MoE layers too
        moe += tuple(range(layers, layers + mtp_layers))
    moe_inter = require(hf, "moe_intermediate_size")
    heads = require(hf, "num_attention_heads")
    return ModelDims(
        model_type="deepseek_v3",
        num_layers=layers,
        hidden=require(hf, "hidden_size"),
        heads=heads,
        kv_heads=heads,
        head_dim=require(hf, "qk_nope_head_dim") + require(hf, "qk_rope_head_dim"),
        intermediate=require(hf, "intermediate_size"),
        vocab=require(hf, "vocab_size"),
        tied=bool(hf.get("tie_word_embeddings", False)),
        num_experts=num_experts,
        moe_intermediate=moe_inter,
        shared_intermediate=moe_inter * (hf.get("n_shared_experts") or 0),
        top_k=hf.get("num_experts_per_tok", 0),
        moe_layers=moe,
        q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=require(hf, "kv_lora_rank"),
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=require(hf, "v_head_dim"),
        mtp_layers=mtp_layers,
    )


def mla(d: ModelDims, p: str, dtype: str, layer: int, mtp: bool) -> Iterator[LogicalTensor]:
    h, nh = d.hidden, d.heads
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim

    def t(name: str, shape: tuple[int, ...]) -> LogicalTensor:
        return LogicalTensor(p + name, shape, dtype, layer, mtp=mtp)

    if d.q_lora_rank:
        yield t("q_a_proj.weight", (d.q_lora_rank, h))
        yield t("q_a_layernorm.weight", (d.q_lora_rank,))
        yield t("q_b_proj.weight", (nh * qk, d.q_lora_rank))
    else:
        yield t("q_proj.weight", (nh * qk, h))
    yield t("kv_a_proj_with_mqa.weight", (d.kv_lora_rank + d.qk_rope_head_dim, h))
    yield t("kv_a_layernorm.weight", (d.kv_lora_rank,))
    yield t("kv_b_proj.weight", (nh * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank))
    yield t("o_proj.weight", (h, nh * d.v_head_dim))


def layer(d: ModelDims, i: int, dtype: str, mtp: bool = False) -> Iterator[LogicalTensor]:
    p = f"model.layers.{i}."
    h = d.hidden
    yield LogicalTensor(p + "input_layernorm.weight", (h,), dtype, i, mtp=mtp)
    yield from mla(d, p + "self_attn.", dtype, i, mtp)
    yield LogicalTensor(p + "post_attention_layernorm.weight", (h,), dtype, i, mtp=mtp)
    yield from mlp(d, p, dtype, i, mtp, moe=mtp or d.is_moe(i))


def mlp(d: ModelDims, p: str, dtype: str, i: int, mtp: bool,
        moe: bool) -> Iterator[LogicalTensor]:
    """Layer `i`'s MLP under prefix `p`: where `moe`, routed experts behind a sigmoid router
    with its `e_score_correction_bias` (an fp32 buffer) and the shared experts; else one
    dense gated MLP (GLM-4.5's MoE layers are the same)."""
    h = d.hidden
    if moe:
        yield LogicalTensor(p + "mlp.gate.weight", (d.num_experts, h), dtype, i, mtp=mtp)
        yield LogicalTensor(p + "mlp.gate.e_score_correction_bias", (d.num_experts,),
                            "float32", i, buffer=True, mtp=mtp)
        for e in range(d.num_experts):
            yield from dense.gated_mlp(f"{p}mlp.experts.{e}.", h, d.moe_intermediate,
                                       dtype, i, mtp)
        if d.shared_intermediate:
            yield from dense.gated_mlp(p + "mlp.shared_experts.", h, d.shared_intermediate,
                                       dtype, i, mtp)
    else:
        yield from dense.gated_mlp(p + "mlp.", h, d.intermediate, dtype, i, mtp)


def mtp_extras(d: ModelDims, i: int, dtype: str) -> Iterator[LogicalTensor]:
    """The MTP module's own tensors (besides its decoder layer), as checkpoints name them."""
    p, h = f"model.layers.{i}.", d.hidden
    yield LogicalTensor(p + "embed_tokens.weight", (d.vocab, h), dtype, i, mtp=True)
    yield LogicalTensor(p + "enorm.weight", (h,), dtype, i, mtp=True)
    yield LogicalTensor(p + "hnorm.weight", (h,), dtype, i, mtp=True)
    yield LogicalTensor(p + "eh_proj.weight", (h, 2 * h), dtype, i, mtp=True)
    yield LogicalTensor(p + "shared_head.norm.weight", (h,), dtype, i, mtp=True)
    yield LogicalTensor(p + "shared_head.head.weight", (d.vocab, h), dtype, i, mtp=True)


def tensors(d: ModelDims, dtype: str) -> Iterator[LogicalTensor]:
    return with_mtp(d, dtype, layer)


def with_mtp(d: ModelDims, dtype: str, decoder_layer: Callable[..., Iterator[LogicalTensor]]
             ) -> Iterator[LogicalTensor]:
    """A checkpoint's tensors in its order: the embeddings, the decoder layers
    (`decoder_layer(d, i, dtype)`), the head, then each MTP layer: its own tensors
    (`mtp_extras`) and a decoder layer (`decoder_layer(..., mtp=True)`). GLM-4.5 carries the
    same MTP module."""
    def body() -> Iterator[LogicalTensor]:
        for i in range(d.num_layers):
            yield from decoder_layer(d, i, dtype)

    yield from dense.embeddings_head(d, dtype, body())
    for i in range(d.num_layers, d.num_layers + d.mtp_layers):
        yield from mtp_extras(d, i, dtype)
        yield from decoder_layer(d, i, dtype, mtp=True)
