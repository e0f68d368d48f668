"""vLLM 0.33 target layout: every engine rank's `named_parameters()` as pieces.

Rank numbering: `rank = replica * engine_world + local`, `local = (dp * pp + p) * tp + t`
(vLLM's `initialize_model_parallel`: ExternalDP x DP x PP x PCP x TP, TP fastest).

Per rank (TP size `tp`, TP rank `t`):
- `qkv_proj` = [q heads of t; its kv heads; the same v heads]; when `tp > ng` kv head
  `t // (tp/ng)` is replicated on `tp/ng` ranks. `o_proj`/`down_proj`: column slices.
- `gate_up_proj` = [gate rows of t; up rows of t].
- `embed_tokens`/`lm_head`: vocab padded to a multiple of 64, `per = padded/tp` rows each,
  rank t holds `[t*per, min((t+1)*per, V))`; the tail is padding. A tied `lm_head` is the
  same parameter as `embed_tokens` and not listed.
- MoE: `w13_weight [E_loc, 2*I/mtp, H]` ([gate; up] per expert; [up; gate] with
  `w13_order: w3w1`, FlashInfer-CUTLASS's runtime order), `w2_weight [E_loc, H,
  I/mtp]`. Without EP the experts are TP-split over the dp*tp ranks of a PP stage; with
  EP, `ep = dp*tp`, `ep_rank = d*tp + t`, MoE TP 1, "linear" placement (uneven counts).
  With EP, TP > 1 and DP > 1 (vLLM's sequence-parallel MoE) shared experts are replicated.
- MLA: `fused_qkv_a_proj` = [q_a_proj; kv_a_proj_with_mqa] replicated, `q_b_proj` and
  `kv_b_proj` split by head, `o_proj` row-parallel. MTP layers are not loaded.
- PP: global layer indices; a stage holds only its layers (`get_pp_indices`); embedding
  on the first stage, norm and lm_head on the last (tied: embedding on the last too).
  vLLM's Qwen3-MoE keeps embedding, norm and lm_head on every stage (no PPMissingLayer).

This module cuts the engine (`shard`, `layout`, `identity`) and lists what vLLM derives
(`derived_rank`); `vllm_rank.py` lists one rank's tensors from its `Shard`.
"""

from __future__ import annotations

from typing import Any

from planner.layouts import rules
from planner.layouts.base import Layout, RankLayout
from planner.layouts.vllm_gpt_oss import GptOssBuilder
from planner.layouts.vllm_gpt_oss import check as gpt_oss_check
from planner.layouts.vllm_rank import (
    VOCAB_PAD,
    Names,
    RankBuilder,
    Shard,
    Split,
    eplb_layers,
    padded_vocab,
)
from planner.spec import SUPPORTED_MODEL_TYPES, ModelSpec
from schemas.config import TargetConfig, fail

FAMILIES = SUPPORTED_MODEL_TYPES
"""The model_types these rules cover (others: specs from transformers, no rules)."""
def pp_layers(num_layers: int, pp: int, stage: int) -> range:
    """vLLM/SGLang `get_pp_indices`: the remainder goes to the stages before the last."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    start = sum(parts[:stage])
    return range(start, start + parts[stage])


def check_common(spec: ModelSpec, cfg: TargetConfig, attn_tp: int, moe_tp: int,
                 ep_size: int) -> None:
    """Checks shared by vLLM and SGLang; `attn_tp` is the key `target.tp` names."""
    d = spec.dims
    rules.attention_tp("target.tp", cfg.tp, attn_tp, d)
    rules.mlp_tp("target.tp", cfg.tp, d)
    padded = padded_vocab(d.vocab)
    if padded % cfg.tp:
        fail("target.tp", cfg.tp, f"must divide the padded vocab {padded} (vocab_size="
             f"{d.vocab} padded to a multiple of {VOCAB_PAD}); use one of "
             f"{rules.divisors(padded)}")
    rules.pp_fits("target.pp", cfg.pp, d)
    if d.moe_layers and d.moe_intermediate % moe_tp:
        times = f"times target.dp={cfg.dp} " if moe_tp != cfg.tp else ""
        fail("target.tp", cfg.tp, f"{times}(the expert TP without target.ep, {moe_tp}) must "
             f"divide moe_intermediate_size={d.moe_intermediate}; use one of "
             f"{rules.divisors(d.moe_intermediate)} or set target.ep: true")
    if cfg.placement is not None:
        check_placement(spec, cfg, ep_size)
    elif d.moe_layers and ep_size > d.num_experts:
        fail("target.ep", cfg.ep, f"spreads {d.num_experts} experts over {ep_size} ranks, "
             "leaving some empty; use fewer ranks or disable target.ep")


def check_placement(spec: ModelSpec, cfg: TargetConfig, ep_size: int) -> None:
    """`target.placement` (EPLB) needs an MoE model under expert parallelism, and a table of
    one row per MoE layer whose physical slots split evenly over the EP ranks."""
    d = spec.dims
    if not d.moe_layers:
        fail("target.placement", "(a table)", "is for MoE models; remove it")
    if not cfg.ep:
        fail("target.placement", "(a table)", "places experts over EP ranks; set "
             "target.ep: true (EPLB needs expert parallelism) or remove it")
    if cfg.placement.physical // ep_size == 0:
        fail("target.placement", f"{cfg.placement.physical} physical experts",
             f"leave EP ranks empty over {ep_size}; give at least one slot a rank")
    cfg.placement.check(d.num_experts, len(eplb_layers(d)), ep_size)


def check(spec: ModelSpec, cfg: TargetConfig) -> None:
    rules.has_rules("target.engine", cfg.engine, spec.dims, FAMILIES)
    moe = cfg.dp * cfg.tp
    check_common(spec, cfg, cfg.tp, 1 if cfg.ep else moe, moe if cfg.ep else 1)
    if spec.dims.model_type == "gpt_oss":
        gpt_oss_check(spec, cfg)


def shard(spec: ModelSpec, cfg: TargetConfig, d: int, p: int, t: int) -> Shard:
    """vLLM's cut for DP rank d, PP stage p, TP rank t."""
    flat = Split(cfg.dp * cfg.tp, d * cfg.tp + t)
    tp = Split(cfg.tp, t)
    every_stage = spec.dims.model_type == "qwen3_moe"
    last = p == cfg.pp - 1
    # vLLM's sequence-parallel MoE (`use_sequence_parallel_moe`: EP, TP > 1, DP > 1 with
    # the default all2all backend) replicates the shared experts (`disable_tp`)
    sequence_parallel = cfg.ep and cfg.tp > 1 and cfg.dp > 1
    return Shard(attn=tp, mlp=tp, vocab=tp,
                 moe_tp=Split() if cfg.ep else flat, ep=flat if cfg.ep else Split(),
                 layers=pp_layers(spec.dims.num_layers, cfg.pp, p),
                 embed=every_stage or p == 0 or (spec.dims.tied and last),
                 head=every_stage or last, shared=Split() if sequence_parallel else None)


def layout(spec: ModelSpec, cfg: TargetConfig) -> Layout:
    """The vLLM layout of `cfg.replicas` engines of `cfg.dp * cfg.pp * cfg.tp` ranks."""
    check(spec, cfg)
    names = Names(experts="experts." if cfg.expert_names == "experts" else Names().experts)
    shards = [shard(spec, cfg, d, p, t)
              for d in range(cfg.dp) for p in range(cfg.pp) for t in range(cfg.tp)]
    return build("vllm", spec, cfg, shards, names)


def build(framework: str, spec: ModelSpec, cfg: TargetConfig, shards: list[Shard],
          names: Names) -> Layout:
    """One engine's ranks (`shards`, in engine rank order), repeated for every replica."""
    builder = GptOssBuilder if spec.dims.model_type == "gpt_oss" else RankBuilder
    engine = [tuple(builder(spec, cfg, s, names).tensors()) for s in shards]
    ranks = tuple(RankLayout(rank=r * len(engine) + i, replica=r, tensors=tensors)
                  for r in range(cfg.replicas) for i, tensors in enumerate(engine))
    return Layout(side="target", framework=framework, ranks=ranks, replicas=cfg.replicas)


def identity(cfg: TargetConfig, rank: int) -> dict[str, int | str]:
    """Plan target rank `rank` (0-based on the target side) as vLLM coordinates
    (`schemas/identity.py`): `local = (dp * pp + p) * tp + t`; `ep = dp * tp + t` with EP."""
    replica, local = divmod(rank, cfg.engine_world)
    t, rest = local % cfg.tp, local // cfg.tp
    return {"framework": "vllm", "replica": replica, "dp": rest // cfg.pp, "tp": t,
            "pp": rest % cfg.pp, "ep": (rest // cfg.pp) * cfg.tp + t if cfg.ep else 0}


KV_B = ".kv_b_proj.weight"


def derived_rank(rank: RankLayout) -> list[dict[str, Any]]:
    """What vLLM derives from one target rank's transferred bytes as copies (refresh
    entries of the header key `derived`; rules and format in `planner/derived.py`): MLA's
    `W_UK_T`/`W_UV` where `kv_b_proj` is block-FP8 (`mla_absorb`)."""
    dtypes = {t.name: t.dtype for t in rank.tensors}
    out = []
    for name, dtype in dtypes.items():
        if name.endswith(KV_B) and dtype.startswith("float8"):
            module = name.removesuffix(KV_B)
            reads = [name] + [n for n in (name + "_scale_inv",) if n in dtypes]
            out.append({"rule": "mla_absorb", "engine": "vllm", "module": module,
                        "reads": reads, "writes": ["W_UK_T", "W_UV"]})
    return out
