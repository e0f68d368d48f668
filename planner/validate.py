"""Checks that span config sections and the model, and `load` (YAML + spec + checks).

`schemas.config` checks each section alone; here live the rules that need the model
spec or two sections at once: tp against heads, groups, intermediate sizes and vocab;
pp against layers; experts against ep; world sizes against `cluster.hosts`. Each rule
raises `ConfigError` naming the full key, the bad value and the fix.
"""

from __future__ import annotations

import math

from planner.spec import ModelDims, ModelSpec, load_spec
from schemas.config import ClusterConfig, Config, ConfigError, SourceConfig, TargetConfig


def load(config_path: str) -> tuple[Config, ModelSpec]:
    """Read a YAML config and its model's config.json, and check them together."""
    from schemas.config import load_config

    cfg = load_config(config_path)
    spec = load_spec(cfg.model_config_path, cfg.model.num_layers, cfg.model.overrides,
                     cfg.model.mtp)
    validate(cfg, spec)
    return cfg, spec


def validate(config: Config, spec: ModelSpec) -> None:
    """Raise `ConfigError` on the first rule that `config` breaks for this model."""
    d = spec.dims
    _check_source(config.source, d)
    _check_target(config.target, d)
    _check_hosts(config)


def _fail(key: str, value: object, fix: str) -> None:
    raise ConfigError(f"{key}: {value!r} {fix}")


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0 and k <= 64)


def _divides(key: str, value: int, n: int, what: str) -> None:
    """`value` must divide the model number `n` (named `what`)."""
    if n % value:
        _fail(key, value, f"must divide {what}={n}; use one of {_divisors(n)}")


def _attention_tp(key: str, tp: int, d: ModelDims) -> None:
    """Heads split evenly over tp; KV groups either split evenly or are replicated."""
    _divides(key, tp, d.heads, "num_attention_heads")
    if not d.mla and d.kv_heads % tp and tp % d.kv_heads:
        _fail(key, tp, f"must divide num_key_value_heads={d.kv_heads} or be a multiple of it "
                       "(GQA groups are split or replicated whole)")


def _has_dense_layers(d: ModelDims) -> bool:
    return any(not d.is_moe(i) for i in range(d.num_layers))


def _mlp_tp(key: str, tp: int, d: ModelDims) -> None:
    if _has_dense_layers(d):
        _divides(key, tp, d.intermediate, "intermediate_size")
    if d.shared_intermediate:
        _divides(key, tp, d.shared_intermediate, "the shared experts' intermediate size")


def _check_source(s: SourceConfig, d: ModelDims) -> None:
    _attention_tp("source.tp", s.tp, d)
    _mlp_tp("source.tp", s.tp, d)
    if s.framework == "megatron" and s.vocab_padding == "none":
        if d.vocab % s.tp:
            _fail("source.tp", s.tp, f"must divide vocab_size={d.vocab} when "
                  "source.vocab_padding is none; set source.vocab_padding: megatron")
    if s.framework == "megatron" and d.mla and not s.transformer_engine:
        # The local spec splits the MLA down projections' rows over tp (TE replicates them).
        if d.q_lora_rank and d.q_lora_rank % s.tp:
            _fail("source.tp", s.tp, f"must divide q_lora_rank={d.q_lora_rank} (Megatron's local "
                  "spec splits linear_q_down_proj); set source.transformer_engine: true or "
                  f"use one of {_divisors(d.q_lora_rank)}")
        kv_rows = d.kv_lora_rank + d.qk_rope_head_dim
        if kv_rows % s.tp:
            _fail("source.tp", s.tp, f"must divide kv_lora_rank + qk_rope_head_dim={kv_rows} "
                  "(Megatron's local spec splits linear_kv_down_proj); set "
                  f"source.transformer_engine: true or use one of {_divisors(kv_rows)}")
    if s.pp > d.num_layers:
        _fail("source.pp", s.pp, f"exceeds the model's {d.num_layers} layers; use at most "
                                 f"{d.num_layers} stages")
    _check_pp_split(s, d)
    if not d.num_experts:
        if s.ep != 1:
            _fail("source.ep", s.ep, "is set but the model is dense (no experts); remove it")
        if s.etp is not None and s.etp != s.tp:
            _fail("source.etp", s.etp, "is set but the model is dense (no experts); remove it")
        return
    _divides("source.ep", s.ep, d.num_experts, "the number of routed experts")
    _divides("source.etp" if s.etp is not None else "source.tp", s.expert_tp,
             d.moe_intermediate, "moe_intermediate_size")
    if s.framework == "megatron" and (s.tp * s.dp) % (s.expert_tp * s.ep):
        _fail("source.ep", s.ep, f"times expert tp {s.expert_tp} must divide source.tp * "
              f"source.dp = {s.tp * s.dp} (Megatron's expert grid etp*ep*edp = tp*dp); "
              "change source.ep, source.etp or source.dp")


def _check_pp_split(s: SourceConfig, d: ModelDims) -> None:
    first, last = s.pp_first_stage_layers, s.pp_last_stage_layers
    if first is None and last is None:
        if d.num_layers % s.pp:
            _fail("source.pp", s.pp, f"must divide the model's {d.num_layers} layers; use one "
                  f"of {_divisors(d.num_layers)}, or set source.pp_first_stage_layers / "
                  "pp_last_stage_layers")
        return
    key = "source.pp_first_stage_layers" if first is not None else "source.pp_last_stage_layers"
    if s.pp < 2:
        _fail(key, first if first is not None else last, "needs source.pp >= 2; remove it")
    middle = s.pp - (first is not None) - (last is not None)
    rest = d.num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle == 0 and rest) or (middle and (rest % middle or rest < middle)):
        _fail(key, first if first is not None else last,
              f"leaves {rest} of {d.num_layers} layers for {middle} other stage(s), which "
              "must split them evenly (at least one each); change the stage layer counts")


def _check_target(t: TargetConfig, d: ModelDims) -> None:
    attn_tp = t.tp // t.dp if t.dp_attention else t.tp
    if t.dp_attention and t.tp % t.dp:
        _fail("target.dp", t.dp, f"must divide target.tp={t.tp} with dp_attention "
                                 "(attention tp = tp/dp)")
    _attention_tp("target.tp", attn_tp, d)
    _mlp_tp("target.tp", t.tp, d)
    padded = math.ceil(d.vocab / 64) * 64
    if padded % t.tp:
        _fail("target.tp", t.tp, f"must divide the vocab padded to 64 ({d.vocab} -> {padded})"
                                 f"; use one of {_divisors(padded)}")
    if t.pp > d.num_layers:
        _fail("target.pp", t.pp, f"exceeds the model's {d.num_layers} layers; use at most "
                                 f"{d.num_layers} stages")
    if not d.num_experts:
        if t.ep:
            _fail("target.ep", True, "is set but the model is dense (no experts); remove it")
        return
    if t.engine == "vllm":
        moe_tp = 1 if t.ep else t.tp * t.dp  # vLLM splits each expert over dp*tp ranks
        if d.moe_intermediate % moe_tp:
            _fail("target.tp", t.tp, f"times target.dp={t.dp} (vLLM's expert TP without EP, "
                  f"{moe_tp}) must divide moe_intermediate_size={d.moe_intermediate}; change "
                  "target.tp / target.dp or set target.ep: true")
    else:
        if t.ep:
            _divides("target.tp", t.tp, d.num_experts, "the number of routed experts (SGLang "
                     "EP size = tp)")
        else:
            _divides("target.tp", t.tp, d.moe_intermediate, "moe_intermediate_size")


def needed_hosts(config: Config) -> int:
    """Hosts that the source and target world sizes need under the cluster's placement."""
    c: ClusterConfig = config.cluster
    s, t, g = config.source.world, config.target.world, c.gpus_per_host
    if c.placement == "disaggregated":
        return math.ceil(s / g) + math.ceil(t / g)
    src_per_host = c.source_gpus_per_host if c.source_gpus_per_host is not None else g // 2
    if src_per_host < 1:
        _fail("cluster.gpus_per_host", g, "must be at least 2 with placement: colocated "
                                          "(source and target GPUs share each host)")
    return max(math.ceil(s / src_per_host), math.ceil(t / (g - src_per_host)))


def _check_hosts(config: Config) -> None:
    c = config.cluster
    need = needed_hosts(config)
    if c.hosts is not None and c.hosts != need:
        s, t = config.source.world, config.target.world
        _fail("cluster.hosts", c.hosts,
              f"does not match the world sizes: source {s} GPUs + target {t} GPUs "
              f"({c.placement}, {c.gpus_per_host} GPUs per host) need {need} hosts; set "
              f"cluster.hosts: {need} or remove it")
