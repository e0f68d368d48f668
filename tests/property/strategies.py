"""Hypothesis strategies: small model specs, parallel configs, clusters, options, cases.

A `Case` is everything one compile needs: the spec, both layouts, and the config (cluster
and options; its source/target sections describe the layouts). Cases come from two
generators:
- `synthetic_cases`: random hand-built layouts (`tests/property/layouts.py`) of any spec;
- `framework_cases`: real framework layouts (megatron/fsdp2 -> vllm/sglang) from random
  configs that `planner.validate.validate` accepts, over every framework and engine
  `schemas.config` lists.
"""

from __future__ import annotations

from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

from planner.frameworks import build_layout
from planner.layouts.base import Layout
from planner.spec import ModelSpec, spec_from_hf
from planner.validate import validate
from schemas.config import (
    DTYPES,
    SOURCES,
    TARGETS,
    ClusterConfig,
    Config,
    ConfigError,
    ModelConfig,
    Options,
    SourceConfig,
    TargetConfig,
)
from tests.property.layouts import random_layout


class Case:
    """One compile's inputs (a plain class: hypothesis prints it with `__repr__`)."""

    def __init__(self, spec: ModelSpec, src: Layout, dst: Layout, cfg: Config,
                 hf: dict[str, Any]) -> None:
        self.spec, self.src, self.dst, self.cfg, self.hf = spec, src, dst, cfg, hf

    def __repr__(self) -> str:
        s, t = self.cfg.source, self.cfg.target
        return (f"Case(\n  model={self.hf}\n  source={s}\n  target={t}\n"
                f"  cluster={self.cfg.cluster}\n  options={self.cfg.options}\n"
                + (f"  src layout:\n{layout_text(self.src)}\n  dst layout:\n"
                   f"{layout_text(self.dst)}\n" if self.src.framework == "synthetic" else "")
                + ")")


def layout_text(layout: Layout) -> str:
    """One line per physical tensor: rank, name, shape, dtype, pieces (tensor box @ at)."""
    lines = []
    for rl in layout.ranks:
        for pt in rl.tensors:
            pieces = "; ".join(f"{p.tensor} {list(p.offsets)}+{list(p.sizes)} @{list(p.at)}"
                               + (f" dims={list(p.dims)}" if p.dims is not None else "")
                               for p in pt.pieces)
            lines.append(f"    r{rl.rank} {pt.name} {list(pt.shape)} {pt.dtype}: {pieces}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ models

@st.composite
def dense_hf(draw: st.DrawFn) -> dict[str, Any]:
    kv = draw(st.integers(1, 4))
    heads = kv * draw(st.integers(1, 3))
    return dict(model_type=draw(st.sampled_from(["qwen3", "llama", "qwen2"])),
                hidden_size=draw(st.integers(4, 48)), num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=draw(st.sampled_from([2, 4, 6, 8])),
                intermediate_size=draw(st.integers(2, 64)),
                vocab_size=draw(st.integers(3, 150)),
                num_hidden_layers=draw(st.integers(1, 3)),
                tie_word_embeddings=draw(st.booleans()))


@st.composite
def qwen3_moe_hf(draw: st.DrawFn) -> dict[str, Any]:
    hf = draw(dense_hf())
    layers = hf["num_hidden_layers"]
    hf.update(model_type="qwen3_moe", num_experts=draw(st.integers(1, 6)),
              moe_intermediate_size=draw(st.integers(2, 24)),
              num_experts_per_tok=1, decoder_sparse_step=draw(st.integers(1, 2)),
              mlp_only_layers=sorted(draw(st.sets(st.integers(0, layers - 1), max_size=1))))
    return hf


@st.composite
def deepseek_hf(draw: st.DrawFn) -> dict[str, Any]:
    return dict(model_type="deepseek_v3", hidden_size=draw(st.integers(4, 40)),
                num_attention_heads=draw(st.integers(1, 4)),
                num_key_value_heads=1,
                q_lora_rank=draw(st.sampled_from([None, 6, 16])),
                kv_lora_rank=draw(st.integers(2, 16)),
                qk_nope_head_dim=draw(st.integers(1, 8)),
                qk_rope_head_dim=draw(st.integers(1, 4)),
                v_head_dim=draw(st.integers(1, 8)),
                intermediate_size=draw(st.integers(2, 48)),
                moe_intermediate_size=draw(st.integers(2, 16)),
                n_routed_experts=draw(st.integers(1, 5)),
                n_shared_experts=draw(st.integers(0, 2)),
                num_experts_per_tok=1,
                first_k_dense_replace=draw(st.integers(0, 2)),
                moe_layer_freq=1,
                num_nextn_predict_layers=draw(st.integers(0, 1)),
                vocab_size=draw(st.integers(3, 120)),
                num_hidden_layers=draw(st.integers(1, 3)),
                tie_word_embeddings=False)


@st.composite
def fp8_hf(draw: st.DrawFn) -> dict[str, Any]:
    """Dense or MoE models whose linear weights split into whole 128x128 blocks under small
    TP (block-FP8 targets need block-aligned shards)."""
    kv = draw(st.integers(1, 2))
    hf = dict(model_type=draw(st.sampled_from(["qwen3", "llama", "qwen3_moe"])),
              hidden_size=128 * draw(st.integers(1, 2)), num_attention_heads=kv *
              draw(st.integers(1, 2)), num_key_value_heads=kv, head_dim=128,
              intermediate_size=128 * draw(st.integers(1, 2)),
              vocab_size=draw(st.integers(3, 40)), num_hidden_layers=1,
              tie_word_embeddings=draw(st.booleans()))
    if hf["model_type"] == "qwen3_moe":
        hf.update(num_experts=draw(st.integers(1, 2)), moe_intermediate_size=128,
                  num_experts_per_tok=1)
    return hf


def model_hf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(dense_hf(), qwen3_moe_hf(), deepseek_hf())


def spec_of(hf: dict[str, Any]) -> ModelSpec:
    try:
        return spec_from_hf(hf)
    except ConfigError:
        assume(False)
        raise


# ------------------------------------------------------------------------ cluster, options

@st.composite
def clusters(draw: st.DrawFn) -> ClusterConfig:
    g = draw(st.sampled_from([1, 2, 3, 4, 8]))
    nics = draw(st.sampled_from([n for n in range(1, g + 1) if g % n == 0]))
    nic_gpus = None
    if g > 1 and draw(st.integers(0, 3)) == 0:  # an explicit, uneven GPU -> NIC map
        nics = draw(st.integers(1, g))
        owner = [draw(st.integers(0, nics - 1)) for _ in range(g)]
        owner[:nics] = range(nics)  # every NIC serves a GPU
        nic_gpus = tuple(tuple(x for x in range(g) if owner[x] == n) for n in range(nics))
    colocated = g > 1 and draw(st.booleans())
    return ClusterConfig(
        gpus_per_host=g, nics_per_host=nics, nic_gpus=nic_gpus,
        nic_gbps=draw(st.sampled_from([25.0, 100.0, 400.0])),
        nvlink_gbps=draw(st.sampled_from([400.0, 3600.0])),
        placement="colocated" if colocated else "disaggregated",
        source_gpus_per_host=draw(st.integers(1, g - 1)) if colocated else None)


@st.composite
def options(draw: st.DrawFn) -> Options:
    max_write = draw(st.sampled_from([4096, 4099, 5000, 8192, 65536, 64 << 20]))
    staging = draw(st.one_of(st.just(256 << 20), st.integers(max_write, 4 * max_write),
                             st.integers(0, max_write)))
    return Options(max_write_bytes=max_write, staging_bytes=staging,
                   write_overhead_us=draw(st.sampled_from([0.0, 0.5, 2.0, 50.0])),
                   pack_gbps=draw(st.sampled_from([1.0, 2000.0, 1e6])),
                   pack_overhead_us=draw(st.sampled_from([0.0, 10.0, 1000.0])))


# ------------------------------------------------------------------------------- cases

@st.composite
def synthetic_cases(draw: st.DrawFn, src_dtype: str | None = None,
                    dst_dtype: str | None = None, replicated: bool | None = None) -> Case:
    """Random hand-built layouts of a random spec (`replicated`: every source rank holds the
    whole model, as with pure data parallelism)."""
    hf = draw(model_hf())
    spec = spec_of(hf)
    sd = src_dtype or draw(st.sampled_from(DTYPES))
    td = dst_dtype or draw(st.sampled_from(DTYPES))
    full = draw(st.booleans()) if replicated is None else replicated
    s_per = 1 if full else draw(st.integers(1, 4))
    s_rep = draw(st.integers(2, 4)) if full else draw(st.integers(1, 2))
    t_per, t_rep = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    src = draw(random_layout(spec, "source", s_per, s_rep, sd))
    dst = draw(random_layout(spec, "target", t_per, t_rep, td))
    cfg = Config(model=ModelConfig("synthetic"),
                 source=SourceConfig("fsdp2", dp=s_per, dp_replicate=s_rep, dtype=sd),
                 target=TargetConfig("vllm", tp=t_per, replicas=t_rep, dtype=td),
                 cluster=draw(clusters()), options=draw(options()))
    return Case(spec, src, dst, cfg, hf)


@st.composite
def source_configs(draw: st.DrawFn, dtype: str) -> SourceConfig:
    fw = draw(st.sampled_from(SOURCES))
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    if fw == "fsdp2":
        return SourceConfig("fsdp2", tp=tp, dp=draw(st.integers(1, 3)),
                            dp_replicate=draw(st.integers(1, 2)), dtype=dtype,
                            fused_experts=draw(st.booleans()))
    pp = draw(st.integers(1, 3))
    first = draw(st.sampled_from([None, 1])) if pp > 1 else None
    return SourceConfig("megatron", tp=tp, pp=pp, dp=draw(st.integers(1, 2)),
                        ep=draw(st.sampled_from([1, 2])),
                        etp=draw(st.sampled_from([None, 1, 2])), dtype=dtype,
                        vocab_padding=draw(st.sampled_from(["megatron", "none"])),
                        transformer_engine=draw(st.booleans()),
                        expert_layout=draw(st.sampled_from(["grouped", "sequential"])),
                        pp_first_stage_layers=first)


@st.composite
def target_configs(draw: st.DrawFn, dtype: str) -> TargetConfig:
    engine = draw(st.sampled_from(TARGETS))
    dp_attention = engine == "sglang" and draw(st.booleans())
    return TargetConfig(engine, tp=draw(st.sampled_from([1, 2, 3, 4])),
                        dp=draw(st.integers(1, 2)), pp=draw(st.integers(1, 2)),
                        ep=draw(st.booleans()), replicas=draw(st.integers(1, 2)), dtype=dtype,
                        expert_names=draw(st.sampled_from(["routed_experts", "experts"])),
                        dp_attention=dp_attention)


@st.composite
def framework_cases(draw: st.DrawFn, src_dtype: str | None = None,
                    dst_dtype: str | None = None, fp8: bool = True) -> Case:
    """A random valid (megatron | fsdp2) -> (vllm | sglang) config of a random spec; with
    `fp8`, targets may be `fp8_block128` (the case's spec then has the scale tensors)."""
    td = dst_dtype or draw(st.sampled_from(DTYPES + ("fp8_block128",) * fp8))
    hf = draw(fp8_hf() if td == "fp8_block128" else model_hf())
    spec = spec_of(hf)
    sd = src_dtype or draw(st.sampled_from(DTYPES))
    cfg = Config(model=ModelConfig("random"), source=draw(source_configs(sd)),
                 target=draw(target_configs(td)), cluster=draw(clusters()),
                 options=draw(options()))
    try:
        validate(cfg, spec)
        src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    except ConfigError:
        assume(False)
        raise
    return Case(full_spec(spec, cfg), src, dst, cfg, hf)


def full_spec(spec: ModelSpec, cfg: Config) -> ModelSpec:
    """The spec the compiler sees: FP8 targets add one scale tensor per quantized weight."""
    if cfg.target.dtype == "fp8_block128":
        from planner.fp8 import with_scales

        return with_scales(spec)
    return spec


def cases(src_dtype: str | None = None, dst_dtype: str | None = None, fp8: bool = True
          ) -> st.SearchStrategy[Case]:
    """Synthetic cases and framework cases (with `fp8`, some targets are block-FP8)."""
    return st.one_of(synthetic_cases(src_dtype, dst_dtype),
                     framework_cases(src_dtype, dst_dtype, fp8))
