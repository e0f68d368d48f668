"""Build a real Megatron-Core 0.16.1 GPTModel on CPU (local spec, gloo), for the oracles
and the integration tests: the CUDA patches of a CPU forward (LAYOUTS.md), MLA's local-spec
patch, and `build` (one model chunk; `vp_stage` for virtual pipeline chunks); an oracle
rank's start (`start`), its input (`batch`) and its check of the last stage's logits against
the HF model's (`logits_code`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F

from planner.spec import ModelSpec, spec_from_hf
from schemas.config import SourceConfig


def patch_cuda() -> None:
    """The four CUDA assumptions of a CPU forward (see LAYOUTS.md)."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"  # RoPE, router buffers
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # dropout is off anyway
    moe_utils.te_general_gemm = None  # undefined without Transformer Engine
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings under PP


def patch_mla() -> None:
    """MLA with the local spec: the core attention must accept `k_channels`/`v_channels`
    (enough to build it and compare names and shapes; no forward pass)."""
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer import multi_latent_attention

    init = dpa.DotProductAttention.__init__

    def accepting(self, *a, k_channels=None, v_channels=None, **k):
        init(self, *a, **k)

    dpa.DotProductAttention.__init__ = accepting
    multi_latent_attention.HAVE_TE = False  # its isinstance check needs the TE classes


def _moe_kwargs(hf: dict, cfg: SourceConfig) -> dict:
    layers = hf["num_hidden_layers"]
    if hf["model_type"] == "glm4_moe":  # sigmoid router with expert bias, shared experts
        first = hf.get("first_k_dense_replace", 0)
        return dict(num_moe_experts=hf["n_routed_experts"],
                    moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf[
                        "n_shared_experts"], moe_router_enable_expert_bias=True,
                    moe_router_score_function="sigmoid",
                    moe_router_topk_scaling_factor=hf.get("routed_scaling_factor", 1.0),
                    moe_layer_freq=[int(i >= first) for i in range(layers)],
                    **_expert_kwargs(hf, cfg))
    if hf["model_type"] == "deepseek_v3":
        first = hf.get("first_k_dense_replace", 0)
        return dict(num_moe_experts=hf["n_routed_experts"],
                    moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf[
                        "n_shared_experts"], moe_router_enable_expert_bias=True,
                    moe_router_score_function="sigmoid",
                    moe_layer_freq=[int(i >= first) for i in range(layers)],
                    **_expert_kwargs(hf, cfg))
    return dict(num_moe_experts=hf["num_experts"], **_expert_kwargs(hf, cfg),
                moe_layer_freq=[int(i not in hf.get("mlp_only_layers", []))
                                for i in range(layers)])


def _expert_kwargs(hf: dict, cfg: SourceConfig) -> dict:
    return dict(moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_router_topk=hf["num_experts_per_tok"], moe_router_load_balancing_type="none",
                moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
                moe_grouped_gemm=False, expert_model_parallel_size=cfg.ep,
                expert_tensor_parallel_size=cfg.expert_tp)


def build(hf: dict, cfg: SourceConfig, vocab: int, pre: bool, post: bool,
          vp_stage: int | None = None, dtype: torch.dtype = torch.float32):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    moe = hf["model_type"] in ("qwen3_moe", "deepseek_v3", "glm4_moe")
    qk_norm = hf.get("use_qk_norm", True) if hf["model_type"] == "glm4_moe" else True
    kw = _moe_kwargs(hf, cfg) if moe else {}
    if hf["model_type"] == "deepseek_v3":
        make = MLATransformerConfig
        kw |= dict(q_lora_rank=hf["q_lora_rank"] or None, kv_lora_rank=hf["kv_lora_rank"],
                   qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf[
                       "qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], rope_type="rope")
    else:
        make = TransformerConfig
        kw |= dict(num_query_groups=hf["num_key_value_heads"], kv_channels=hf["head_dim"])
    tc = make(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf.get("intermediate_size", 0) or 4 * hf["hidden_size"],
        normalization="RMSNorm", layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=qk_norm, add_qkv_bias=bool(hf.get("attention_bias", False)),
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp if cfg.vpp > 1 else None,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        sequence_parallel=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        num_layers_in_first_pipeline_stage=cfg.pp_first_stage_layers,
        num_layers_in_last_pipeline_stage=cfg.pp_last_stage_layers, **kw)
    if moe:  # dense and MoE layers (moe_layer_freq): the block spec of local layer specs
        spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False,
                                          normalization="RMSNorm", vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    return GPTModel(tc, spec, vocab_size=vocab, max_sequence_length=64, pre_process=pre,
                    vp_stage=vp_stage,
                    post_process=post, share_embeddings_and_output_weights=hf.get(
                        "tie_word_embeddings", False), position_embedding_type="rope",
                    rotary_percent=hf.get("partial_rotary_factor", 1.0),
                    rotary_base=hf.get("rope_theta", 10000.0))


def hf_logits(hf: dict, full: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(**hf, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(conf).float().eval()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name == "lm_head.weight" and name not in full:
                name = "model.embed_tokens.weight"
            if name.endswith("experts.gate_up_proj"):  # transformers 5.x fused experts
                pre = name[: -len("gate_up_proj")]
                n = p.shape[0]
                p.copy_(torch.stack([torch.cat([full[f"{pre}{e}.gate_proj.weight"],
                                                full[f"{pre}{e}.up_proj.weight"]])
                                     for e in range(n)]))
            elif name.endswith("experts.down_proj"):
                pre = name[: -len("down_proj")]
                p.copy_(torch.stack([full[f"{pre}{e}.down_proj.weight"]
                                     for e in range(p.shape[0])]))
            else:
                p.copy_(full[name])
        return model(ids).logits.float()


def start() -> tuple[int, dict, SourceConfig, ModelSpec]:
    """An oracle rank's process: its JSON argument (argv[1]: "port", "hf", "source"), its
    gloo process group (RANK and WORLD_SIZE from the environment), the CUDA patches of a CPU
    forward; its rank, the HF config, the Megatron source config and the spec."""
    arg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", init_method=arg["init"],
                                         rank=rank, world_size=world)
    patch_cuda()
    hf, cfg = arg["hf"], SourceConfig(framework="megatron", **arg["source"])
    return rank, hf, cfg, spec_from_hf(hf, mtp=False)


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The oracles' input: token ids [2, 6] below `vocab`, their positions, and the causal
    mask (True above the diagonal: not attended)."""
    ids = torch.arange(12).reshape(2, 6) * 7 % vocab
    pos = torch.arange(6).expand(2, 6)
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)[None, None]
    return ids, pos, mask


def logits_code(out: torch.Tensor, tp: int, vocab: int, hf: dict,
                full: dict[str, torch.Tensor], ids: torch.Tensor, rank: int) -> int:
    """On a last pipeline stage, its output `out` (each TP rank's share of the padded vocab)
    gathered over the TP group into the logits of the first `vocab` rows; TP rank 0 prints
    the largest difference from the HF model's logits (weights `full`, input `ids`) and
    gives 1 where it is not below 1e-4; 0 otherwise."""
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(out) for _ in range(tp)]
    torch.distributed.all_gather(parts, out.contiguous(),
                                 group=ps.get_tensor_model_parallel_group())
    if ps.get_tensor_model_parallel_rank() != 0:
        return 0
    logits = torch.cat(parts, -1)[..., :vocab]
    err = (logits - hf_logits(hf, full, ids)).abs().max().item()
    print(f"rank {rank}: max |logits - hf| = {err:.3g}", flush=True)
    return int(not err < 1e-4)
