"""SGLang target layout: the vLLM rules (`planner.layouts.vllm`) with SGLang's differences.

Same as vLLM: `qkv_proj` with KV-head replication, `gate_up_proj`, row-parallel
`o_proj`/`down_proj`, 64-row vocab padding, global layer indices under PP, MLA split by
head. Different (read from SGLang's source, not run):

- Experts are `mlp.experts.w13_weight` / `w2_weight`. EP (`target.ep`) spans the TP group
  (`ep_size = tp`, MoE TP 1) and places experts contiguously: `E % tp == 0`, rank t owns
  `[t*E/tp, (t+1)*E/tp)`. Without EP experts are TP-split over the TP group.
- DeepSeek's fused MLA down projection is `fused_qkv_a_proj_with_mqa` (shared experts are
  assumed unfused, `--disable-shared-experts-fusion`).
- `dp` without DP attention: independent engines inside one target replica (each a full
  copy, ranks dp-major). With `dp_attention`: one engine of `tp` ranks per PP stage;
  attention uses `attn_tp = tp/dp`, TP rank t has attention rank `t % attn_tp`; the
  embedding is replicated (`enable_tp=False`), lm_head and MLPs stay split over all tp.
- PP: embedding on the first stage only; the last stage holds `lm_head.weight` (a copy of
  the embedding when tied and PP > 1; with PP 1 a tied head is the embedding itself).
"""

from __future__ import annotations

from planner.layouts.base import Layout
from planner.layouts.rules import divisors, fail
from planner.layouts.vllm import Names, Shard, Split, build, check_common, pp_layers
from planner.spec import ModelSpec
from schemas.config import TargetConfig

NAMES = Names(experts="mlp.experts.", fused_qkv_a="fused_qkv_a_proj_with_mqa")


def attn_tp(cfg: TargetConfig) -> int:
    return cfg.tp // cfg.dp if cfg.dp_attention else cfg.tp


def check(spec: ModelSpec, cfg: TargetConfig) -> None:
    if cfg.dp_attention and cfg.tp % cfg.dp:
        fail("target.dp", cfg.dp, f"must divide target.tp={cfg.tp} with dp_attention "
             "(attention TP = tp/dp); pick a divisor of tp")
    check_common(spec, cfg, attn_tp(cfg), 1 if cfg.ep else cfg.tp, cfg.tp if cfg.ep else 1)
    d = spec.dims
    if cfg.ep and d.moe_layers and d.num_experts % cfg.tp:
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
                 embed_vocab=Split() if cfg.dp_attention else tp)


def layout(spec: ModelSpec, cfg: TargetConfig) -> Layout:
    """The SGLang layout of `cfg.replicas` target replicas of `cfg.engine_world` ranks."""
    check(spec, cfg)
    engines = 1 if cfg.dp_attention else cfg.dp
    shards = [shard(spec, cfg, p, t)
              for _ in range(engines) for p in range(cfg.pp) for t in range(cfg.tp)]
    return build("sglang", spec, cfg, shards, NAMES)


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
