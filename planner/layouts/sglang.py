"""SGLang target layout: the vLLM rules (`planner.layouts.vllm`) with SGLang's differences.

Same as vLLM: `qkv_proj` with KV-head replication, `gate_up_proj`, row-parallel
`o_proj`/`down_proj`, 64-row vocab padding, global layer indices under PP, MLA split by
head. Different (checked against SGLang 0.5.23 on CPU):

- Experts are `mlp.experts.w13_weight` / `w2_weight`. EP (`target.ep`) spans the TP group
  (`ep_size = tp`, MoE TP 1) and places experts contiguously: `E % tp == 0`, rank t owns
  `[t*E/tp, (t+1)*E/tp)`. Without EP experts are TP-split over the TP group.
- DeepSeek's fused MLA down projection is `fused_qkv_a_proj_with_mqa` (shared experts are
  assumed unfused, `--disable-shared-experts-fusion`).
- `dp` without DP attention: independent engines inside one target replica (each a full
  copy, ranks dp-major). With `dp_attention`: one engine of `tp` ranks per PP stage;
  attention uses `attn_tp = tp/dp`, TP rank t has attention rank `t % attn_tp`; the
  embedding is split over the attention TP group like the attention (padded vocab /
  attn_tp rows; replicated only when attn_tp = 1), lm_head and MLPs stay split over all tp.
- PP: layers split with the remainder on the *last* stages (`pp_layers`); embedding on the
  first stage only; the last stage holds `lm_head.weight` (a copy of the embedding when
  tied and PP > 1; with PP 1 a tied head is the embedding itself). Qwen3-MoE (untied)
  holds `lm_head` on every stage, `model.norm` on the last only.
- Order of `named_parameters()` inside a layer differs from vLLM's (`ORDER`): Qwen3's
  `q_norm`/`k_norm` come before `qkv_proj`; Qwen3-MoE's routed experts before the gate;
  DeepSeek's `kv_a_layernorm` after `o_proj`, its routed experts before shared experts.

Proven against SGLang 0.5.23 on CPU by tests/oracles/test_sglang_oracle.py (bit-exact per
rank: names, order, shapes, dtypes, values).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner.layouts import rules
from planner.layouts.base import Layout, PhysicalTensor, RankLayout
from planner.layouts.rules import divisors
from planner.layouts.vllm import build, check_common
from planner.layouts.vllm_rank import Names, Shard, Split
from planner.spec import ModelSpec
from schemas.config import TargetConfig, fail

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2")
"""The model_types these rules cover (others: specs from transformers, no rules)."""
NAMES = Names(experts="experts.", fused_qkv_a="fused_qkv_a_proj_with_mqa")


def pp_layers(num_layers: int, pp: int, stage: int) -> range:
    """SGLang's `get_pp_indices`: the remainder goes to the *last* stages (vLLM: the ones
    before the last). 3 layers over 2 stages: [0], [1, 2]."""
    base, rem = divmod(num_layers, pp)
    start = stage * base + max(0, stage - (pp - rem))
    return range(start, start + base + (stage >= pp - rem))


def attn_tp(cfg: TargetConfig) -> int:
    return cfg.tp // cfg.dp if cfg.dp_attention else cfg.tp


def check(spec: ModelSpec, cfg: TargetConfig) -> None:
    rules.has_rules("target.engine", cfg.engine, spec.dims, FAMILIES)
    if cfg.dp_attention and cfg.tp % cfg.dp:
        fail("target.dp", cfg.dp, f"must divide target.tp={cfg.tp} with dp_attention "
             "(attention TP = tp/dp); pick a divisor of tp")
    check_common(spec, cfg, attn_tp(cfg), 1 if cfg.ep else cfg.tp, cfg.tp if cfg.ep else 1)
    d = spec.dims
    if cfg.ep and d.moe_layers and d.num_experts % cfg.tp and cfg.placement is None:
        fail("target.tp", cfg.tp, f"must divide the {d.num_experts} experts with target.ep "
             f"(SGLang places experts evenly over ep_size = tp); use one of "
             f"{divisors(d.num_experts)}")


def shard(spec: ModelSpec, cfg: TargetConfig, p: int, t: int) -> Shard:
    """SGLang's cut for PP stage p, TP rank t (of one engine)."""
    tp = Split(cfg.tp, t)
    a = attn_tp(cfg)
    return Shard(attn=Split(a, t % a), mlp=tp, vocab=tp,
                 moe_tp=Split() if cfg.ep else tp, ep=tp if cfg.ep else Split(),
                 layers=pp_layers(spec.dims.num_layers, cfg.pp, p),
                 embed=p == 0, head=p == cfg.pp - 1,
                 embed_vocab=Split(a, t % a) if cfg.dp_attention else tp)


def layout(spec: ModelSpec, cfg: TargetConfig) -> Layout:
    """The SGLang layout of `cfg.replicas` target replicas of `cfg.engine_world` ranks."""
    check(spec, cfg)
    engines = 1 if cfg.dp_attention else cfg.dp
    shards = [shard(spec, cfg, p, t)
              for _ in range(engines) for p in range(cfg.pp) for t in range(cfg.tp)]
    lay = build("sglang", spec, cfg, shards, NAMES)
    kind = spec.dims.model_type
    ranks = [replace(r, tensors=sglang_order(r.tensors, kind)) for r in lay.ranks]
    if kind == "qwen3_moe" and cfg.pp > 1 and not spec.dims.tied:
        ranks = [head_on_every_stage(r, ranks, cfg) for r in ranks]
    return replace(lay, ranks=tuple(ranks))


def head_on_every_stage(r: RankLayout, ranks: list[RankLayout],
                        cfg: TargetConfig) -> RankLayout:
    """SGLang's Qwen3-MoE builds `lm_head` on every PP stage (norm on the last only): a
    rank before the last stage holds the same `lm_head` as its last-stage TP peer."""
    engine = cfg.engine_world
    local = r.rank % engine
    stage = local // cfg.tp % cfg.pp
    if stage == cfg.pp - 1:
        return r
    peer = r.rank + (cfg.pp - 1 - stage) * cfg.tp
    head = next(t for t in ranks[peer].tensors if t.name == "lm_head.weight")
    return replace(r, tensors=(*r.tensors, head))


ORDER = {
    "qwen3": ("q_norm.", "k_norm.", "qkv_proj.", "o_proj."),
    "qwen3_moe": ("qkv_proj.", "o_proj.", "q_norm.", "k_norm.", "experts.w13_weight",
                  "experts.w2_weight", "mlp.gate.weight"),
    "deepseek_v3": ("fused_qkv_a_proj_with_mqa.", "kv_a_proj_with_mqa.", "q_a_layernorm.",
                    "q_b_proj.", "q_proj.", "kv_b_proj.", "o_proj.", "kv_a_layernorm.",
                    "mlp.gate.weight", "e_score_correction_bias", "experts.w13_weight",
                    "experts.w2_weight", "shared_experts.gate_up_proj.",
                    "shared_experts.down_proj."),
}
"""Per family, the order of SGLang's `named_parameters()` inside a decoder layer (the order
its modules create them), for the tensors whose order differs from vLLM's; tensors that
match none keep their place after them (MLPs, layer norms)."""


def sglang_order(tensors: tuple[PhysicalTensor, ...],
                 model_type: str) -> tuple[PhysicalTensor, ...]:
    """Reorder each decoder layer's tensors into SGLang's `named_parameters()` order."""
    order = ORDER.get(model_type, ())

    def key(t: PhysicalTensor) -> int:
        return next((i for i, k in enumerate(order) if k in t.name), len(order))

    out: list[PhysicalTensor] = []
    group: list[PhysicalTensor] = []
    for t in (*tensors, None):
        layer = t is not None and t.name.startswith("model.layers.")
        if group and (not layer or t.name.split(".")[2] != group[0].name.split(".")[2]):
            out += sorted(group, key=key)
            group = []
        if layer:
            group.append(t)
        elif t is not None:
            out.append(t)
    return tuple(out)


MLA_SPLIT = "mla_split"
"""Derived rule: `w_kc`/`w_vc` of an MLA attention, split from its `kv_b_proj.weight`."""


def derived_rank(rank: RankLayout) -> list[dict[str, Any]]:
    """What SGLang derives from one target rank's transferred bytes (refresh entries of the
    header key `derived`, format in the vLLM helper's `planner/derived.py`: `rule`,
    `engine`, `module`, `reads` (the rank's plan tensors), `writes` (the module's derived
    attributes)).

    SGLang's DeepSeek `post_load_weights` builds each MLA layer's `w_kc`
    `[heads, nope, kv_lora]` and `w_vc` `[heads, kv_lora, v]` from `kv_b_proj.weight` as
    *copies* (`.contiguous()`), in every dtype, so a raw write into `kv_b_proj` leaves
    them stale until that step runs again (it copies into the same storage: `data_ptr`s
    stay). Nothing else in SGLang's dense, MoE or tied models is derived from the weights
    (checked against SGLang 0.5.23 on CPU, tests/integrations/test_sglang_update.py).
    """
    out: list[dict[str, Any]] = []
    for t in rank.tensors:
        if t.name.endswith(".self_attn.kv_b_proj.weight"):
            out.append({"rule": MLA_SPLIT, "engine": "sglang",
                        "module": t.name.removesuffix(".kv_b_proj.weight"),
                        "reads": [t.name], "writes": ["w_kc", "w_vc"]})
    return out


def identity(cfg: TargetConfig, rank: int) -> dict[str, int | str]:
    """Plan target rank `rank` (0-based on the target side) as SGLang coordinates
    (`schemas/identity.py`). Without DP attention `dp` is the engine inside the replica;
    with it, `attn_tp = tp % (tp/dp)` and `dp = tp // (tp/dp)` (the attention DP rank)."""
    replica, local = divmod(rank, cfg.engine_world)
    t, rest = local % cfg.tp, local // cfg.tp
    a = attn_tp(cfg)
    dp = t // a if cfg.dp_attention else rest // cfg.pp
    return {"framework": "sglang", "replica": replica, "dp": dp, "tp": t, "pp": rest % cfg.pp,
            "ep": t if cfg.ep else 0, "attn_tp": t % a}
