"""The compile config: what model moves, from which layout, to which, over which cluster.

A config is a YAML file with five sections (`model`, `source`, `target`, `cluster`,
`options`). Each section is a frozen dataclass below, with a docstring under every field.
Checks of one section live in its `__post_init__` (with the bounds: positive sizes, finite
numbers, at most `MAX_RANKS` ranks a side); checks against the model (tp against the
model's heads) live in each layout module's `check(spec, cfg)` and the cluster's host count
in `planner.topology`, which `planner/validate.py` runs. Reading YAML is
`schemas/config_load.py` (`load_config`, `config_from_dict`).

Every error is a `ConfigError` naming the full key, the bad value and the fix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from typing import Any, Literal, get_args

from .errors import ConfigError, OwnValueError, check_each
from .placement import Placement
from .placement import from_plain as placement_from_plain
from .placement import load as load_placement
from .safe_read import short

SourceFramework = Literal["megatron", "fsdp2"]
"""The training frameworks whose shards a plan reads (`source.framework`): the one list of
them, which `schemas.identity` and the compiler's registry (`planner/frameworks.py`) follow."""
TargetEngine = Literal["vllm", "sglang"]
"""The inference engines whose shards a plan writes (`target.engine`): the one list of them."""
SOURCES: tuple[str, ...] = get_args(SourceFramework)
TARGETS: tuple[str, ...] = get_args(TargetEngine)
Dtype = Literal["bfloat16", "float16", "float32"]
"""A source's dtype (`source.dtype`); a target's (`TargetDtype`) adds block FP8."""
TargetDtype = Literal[Dtype, "fp8_block128"]
W13Order = Literal["w1w3", "w3w1"]
LayoutFrom = Literal["auto", "rules", "traced"]
DTYPES: tuple[str, ...] = get_args(Dtype)
MAX_INT = 1 << 53
"""Largest integer any key takes (a byte count fits; 10**30 is a typo or an attack)."""
MAX_RANKS = 16384
"""Most ranks on one side (source world, target world)."""
MAX_LAYERS = 1024
"""Most decoder layers (`model.num_layers`, the config.json's `num_hidden_layers`)."""
MAX_PER_HOST = 1024
"""Most GPUs or NICs in one host."""
def fail(key: str, value: object, fix: str) -> None:
    raise ConfigError(f"{key}: {short(value)} {fix}")


def _either(names: tuple[str, ...]) -> str:
    """`a, b or c`."""
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1])))


def _positive(section: str, name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise OwnValueError(f"{section}.{name}: {short(value)} must be a positive integer "
                            "(>= 1)")


MAX_GBPS = 1e6
"""Fastest link a config (or a plan's header) may claim, in Gb/s (1 Pb/s: past any NIC or
NVLink; larger values only overflow the cost model)."""
MAX_OVERHEAD_US = 1e6
"""Largest fixed cost of one op the cost model takes, in microseconds (1 s)."""


def _bandwidth(key: str, value: float) -> None:
    if not (math.isfinite(value) and 0 < value <= MAX_GBPS):
        fail(key, value, f"must be a positive bandwidth in Gb/s (a number > 0, at most "
              f"{MAX_GBPS:g})")


def _world(keys: str, world: int) -> None:
    if world > MAX_RANKS:
        raise ConfigError(f"{keys}: {world:,} ranks are more than the {MAX_RANKS} one side "
                          "may have; use fewer ranks")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    config: str
    """Path to the model's HF `config.json` (relative paths are relative to the YAML file)."""
    num_layers: int | None = None
    """Override `num_hidden_layers` (small test models); None keeps the config's value."""
    overrides: tuple[tuple[str, int | float | bool | str], ...] = ()
    """Further HF config numbers to override, as a mapping in YAML (`{hidden_size: 256}`)."""
    mtp: bool = True
    """Include the MTP layers that DeepSeek-V3 checkpoints carry (`num_nextn_predict_layers`)."""

    def __post_init__(self) -> None:
        if not self.config:
            fail("model.config", self.config, "must be the path to a HF config.json")
        _positive("model", "num_layers", self.num_layers)
        if self.num_layers is not None and self.num_layers > MAX_LAYERS:
            fail("model.num_layers", self.num_layers, f"is more than {MAX_LAYERS} layers; "
                  "use the model's real layer count")


@dataclass(frozen=True, slots=True)
class SourceConfig:
    framework: SourceFramework
    """The training framework whose shards are read: `megatron` (Megatron-Core) or `fsdp2`."""
    tp: int = 1
    """Tensor-parallel size (Megatron TP; with fsdp2, the TP dim of FSDP2+TP)."""
    pp: int = 1
    """Pipeline-parallel stages (megatron only)."""
    dp: int = 1
    """Data-parallel size: Megatron's DP (replicas of the dense weights); FSDP2's shard size."""
    dp_replicate: int = 1
    """fsdp2 only: HSDP replica groups (each a full FSDP2 shard group)."""
    ep: int = 1
    """Expert-parallel size (megatron only)."""
    etp: int | None = None
    """Expert tensor-parallel size (megatron only); None means equal to `tp`."""
    dtype: Dtype = "bfloat16"
    """dtype of the training weights; a cast is planned where the target dtype differs."""
    vocab_padding: Literal["megatron", "none"] = "megatron"
    """megatron: pad the vocab to a multiple of 128*tp (Megatron-LM) or not at all (Bridge)."""
    transformer_engine: bool = False
    """megatron: names with Transformer Engine's fused norms (`linear_qkv.layer_norm_weight`)."""
    expert_layout: Literal["grouped", "sequential"] = "grouped"
    """megatron: `experts.linear_fc1.weight{i}` (grouped) or `experts.local_experts.{i}.*`."""
    vpp: int = 1
    """megatron: virtual pipeline chunks per PP stage (`virtual_pipeline_model_parallel_size`,
    the interleaved schedule); 1 means no VPP. Chunk v of stage p holds its share of the v-th
    round of layers; each chunk's names start with `model{v}.` when vpp > 1."""
    pp_first_stage_layers: int | None = None
    """megatron: layers on the first PP stage; the rest spread evenly (None: even split)."""
    pp_last_stage_layers: int | None = None
    """megatron: layers on the last PP stage; the rest spread evenly (None: even split)."""
    fused_experts: bool = False
    """fsdp2: experts as transformers 5.x fused `experts.gate_up_proj [E,2I,H]` params."""

    def __post_init__(self) -> None:
        check_each(self._framework_check,
              *(lambda n=name: _positive("source", n, getattr(self, n))
                for name in ("tp", "pp", "vpp", "dp", "dp_replicate", "ep", "etp",
                             "pp_first_stage_layers", "pp_last_stage_layers")))
        if self.dtype not in DTYPES:
            fail("source.dtype", self.dtype, f"is not supported; use one of {', '.join(DTYPES)}")
        if self.framework == "fsdp2":
            for name in ("pp", "vpp", "ep", "etp"):
                value = getattr(self, name)
                if value not in (None, 1):
                    fail(f"source.{name}", value, "is megatron-only; remove it for fsdp2")
        elif self.dp_replicate != 1:
            fail("source.dp_replicate", self.dp_replicate,
                  "is fsdp2-only (HSDP); use source.dp for Megatron data parallel")
        _world("source.tp * source.dp * source.dp_replicate" if self.framework == "fsdp2"
               else "source.tp * source.pp * source.dp", self.world)

    def _framework_check(self) -> None:
        if self.framework not in SOURCES:
            fail("source.framework", self.framework, f"is not supported; use {_either(SOURCES)}")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world(self) -> int:
        if self.framework == "fsdp2":
            return self.tp * self.dp * self.dp_replicate
        return self.tp * self.pp * self.dp


@dataclass(frozen=True, slots=True)
class ShadowConfig:
    """`target.shadow` once read: `full` is `budget_bytes == 0`."""

    budget_bytes: int = 0
    """0: a full shadow (the written tensors once more); else a chunked shadow's bytes."""


def _shadow(value: Any) -> ShadowConfig | None:
    """`target.shadow`: absent, `full`, or `{budget_bytes: N}` (N >= 4096)."""
    if value is None or isinstance(value, ShadowConfig):
        return value
    if value == "full":
        return ShadowConfig(0)
    if isinstance(value, dict) and set(value) == {"budget_bytes"}:
        n = value["budget_bytes"]
        if not isinstance(n, bool) and isinstance(n, int) and 4096 <= n <= MAX_INT:
            return ShadowConfig(n)
        fail("target.shadow.budget_bytes", n, f"must be an integer of bytes in [4096, "
              f"{MAX_INT}]")
    fail("target.shadow", value, "is not supported; use `full` or `{budget_bytes: N}` (or "
          "leave it out: the paused refit)")
    return None


@dataclass(frozen=True, slots=True)
class TargetConfig:
    engine: TargetEngine
    """The inference engine whose shards are written: `vllm` or `sglang`."""
    tp: int = 1
    """Tensor-parallel size of one engine."""
    dp: int = 1
    """Data parallel inside one engine (vLLM `data_parallel_size`; SGLang DP attention)."""
    pp: int = 1
    """Pipeline-parallel stages of one engine."""
    ep: bool = False
    """Expert parallel (`enable_expert_parallel`): experts split over dp*tp ranks, MoE TP 1."""
    replicas: int = 1
    """Independent engines, each receiving the whole model."""
    dtype: TargetDtype = "bfloat16"
    """dtype of the inference weights; `fp8_block128`: linear weights as e4m3 in 128x128
    blocks with float32 `weight_scale_inv` (quantized on the sources), the rest bf16."""
    expert_names: Literal["routed_experts", "experts"] = "routed_experts"
    """vllm: `experts.routed_experts.w13_weight` (0.33) or the older `experts.w13_weight`."""
    dp_attention: bool = False
    """sglang: DP attention (attention weights use attn_tp = tp/dp; world = tp)."""
    w13_order: W13Order = "w1w3"
    """vllm MoE `w13_weight` row order per expert: `w1w3` ([gate; up], the loader's and
    Triton's) or `w3w1` ([up; gate], what FlashInfer-CUTLASS keeps after loading)."""
    layout: LayoutFrom = "auto"
    """vllm: where the layout comes from: `rules` (hand-written, `planner/layouts/vllm.py`),
    `traced` (vLLM 0.33's own `load_weights` recorded on the meta device, cached under
    ~/.cache/rdma-plan; needs torch and vLLM on a cache miss), or `auto` (rules for the
    model types they cover, traced for any other)."""
    shadow: Any = None
    """Zero-pause refit (`executor/shadow.py`): the plan carries each target rank's shadow
    section (`schemas/shadow.py`: the bytes it writes, the switch as ops in chunks). `full`:
    a shadow of the written tensors; `{budget_bytes: N}`: a chunked shadow whose chunks
    (layer by layer where the names allow) each fit N bytes. Absent: no section (the paused
    refit; the plan is the one compiled before the key existed). Read as a `ShadowConfig`."""
    placement: Any = None
    """EPLB: per MoE layer, the logical expert of each physical slot (`schemas/placement.py`):
    a JSON/msgpack file's path or `{physical_to_logical_map: [[...]]}`. Absent: default."""

    def __post_init__(self) -> None:
        check_each(lambda: object.__setattr__(self, "shadow", _shadow(self.shadow)),
              self._engine_checks,
              *(lambda n=name: _positive("target", n, getattr(self, n))
                for name in ("tp", "dp", "pp", "replicas")))
        if self.placement is not None and not isinstance(self.placement, (str, Placement)):
            object.__setattr__(self, "placement", placement_from_plain(self.placement))
        _world("target.tp * target.dp * target.pp * target.replicas", self.world)

    def _engine_checks(self) -> None:
        if self.engine not in TARGETS:
            fail("target.engine", self.engine, f"is not supported; use {_either(TARGETS)}")
        if self.dtype not in get_args(TargetDtype):
            fail("target.dtype", self.dtype,
                  f"is not supported; use one of {', '.join(get_args(TargetDtype))}")
        if self.dp_attention and self.engine != "sglang":
            fail("target.dp_attention", True, "is sglang-only; remove it for vllm")
        if self.w13_order not in get_args(W13Order):
            fail("target.w13_order", self.w13_order,
                 f"is not supported; use {_either(get_args(W13Order))}")
        if self.w13_order != "w1w3" and self.engine != "vllm":
            fail("target.w13_order", self.w13_order, "is vllm-only; remove it")
        if self.layout not in get_args(LayoutFrom):
            fail("target.layout", self.layout,
                 f"is not supported; use {_either(get_args(LayoutFrom))}")
        if self.layout == "traced" and self.engine != "vllm":
            fail("target.layout", self.layout, "is vllm-only; remove it for sglang")

    @property
    def engine_world(self) -> int:
        """GPUs of one engine."""
        if self.engine == "sglang" and self.dp_attention:
            return self.tp * self.pp
        return self.tp * self.dp * self.pp

    @property
    def world(self) -> int:
        return self.engine_world * self.replicas


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    gpus_per_host: int = 8
    """GPUs in each host."""
    nics_per_host: int = 8
    """RDMA NICs in each host; NIC n serves GPUs [n*g/nics, (n+1)*g/nics) unless `nic_gpus`."""
    nic_gbps: float = 400.0
    """Bandwidth of one NIC, in Gb/s (one direction)."""
    nvlink_gbps: float = 3600.0
    """Bandwidth of one GPU's NVLink, in Gb/s (one direction), for same-host writes."""
    placement: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: target ranks on hosts after the source hosts; colocated: each host
    gives its first `source_gpus_per_host` GPUs to source ranks and the rest to targets."""
    source_gpus_per_host: int | None = None
    """colocated only: GPUs of each host that run source ranks (default: half)."""
    hosts: int | None = None
    """Hosts in the cluster; None derives it from the world sizes. Checked when given."""
    nic_gpus: tuple[tuple[int, ...], ...] | None = None
    """Optional explicit GPU list of each NIC (index = NIC within the host)."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_host", "nics_per_host", "source_gpus_per_host", "hosts"):
            _positive("cluster", name, getattr(self, name))
        for name in ("gpus_per_host", "nics_per_host"):
            if getattr(self, name) > MAX_PER_HOST:
                fail(f"cluster.{name}", getattr(self, name),
                      f"is more than {MAX_PER_HOST} per host; give the real count")
        for name in ("nic_gbps", "nvlink_gbps"):
            _bandwidth(f"cluster.{name}", getattr(self, name))
        if self.placement not in ("disaggregated", "colocated"):
            fail("cluster.placement", self.placement, "must be disaggregated or colocated")
        if self.gpus_per_host % self.nics_per_host and self.nic_gpus is None:
            fail("cluster.nics_per_host", self.nics_per_host,
                  f"must divide gpus_per_host={self.gpus_per_host}, or give cluster.nic_gpus")
        if self.placement == "colocated" and self.gpus_per_host < 2:
            fail("cluster.gpus_per_host", self.gpus_per_host, "must be at least 2 with "
                  "placement: colocated (source and target GPUs share each host)")
        if self.source_gpus_per_host is not None:
            if self.placement != "colocated":
                fail("cluster.source_gpus_per_host", self.source_gpus_per_host,
                      "is only used with placement: colocated; remove it")
            if self.source_gpus_per_host >= self.gpus_per_host:
                fail("cluster.source_gpus_per_host", self.source_gpus_per_host,
                      f"must leave target GPUs: use fewer than gpus_per_host={self.gpus_per_host}")
        if self.nic_gpus is not None:
            if len(self.nic_gpus) != self.nics_per_host:
                fail("cluster.nic_gpus", self.nic_gpus,
                      f"must list one GPU list for each of the {self.nics_per_host} NICs")
            seen = sorted(g for gpus in self.nic_gpus for g in gpus)
            if seen != list(range(self.gpus_per_host)):
                fail("cluster.nic_gpus", self.nic_gpus,
                      f"must give every GPU 0..{self.gpus_per_host - 1} exactly one NIC")


@dataclass(frozen=True, slots=True)
class Options:
    max_write_bytes: int = 64 << 20
    """Largest single RDMA write; longer runs are split."""
    staging_bytes: int = 1 << 30
    """Staging memory cap per rank (pack/cast on sources, unpack on targets): a rank
    allocates what its ops use at peak, never more than this. Below it the compiler picks
    each rank's budget (`planner/passes/budget.py`): sources up to the cap (fewer stages),
    targets only what keeps the write window full (they prefer direct writes)."""
    write_overhead_us: float = 2.0
    """Cost model: fixed cost of one write (posting, completion), in microseconds."""
    pack_gbps: float = 2000.0
    """Cost model: throughput of a local strided pack/unpack/cast, in Gb/s."""
    pack_overhead_us: float = 10.0
    """Cost model: fixed cost of one pack or unpack (a kernel launch), in microseconds."""

    def __post_init__(self) -> None:
        if self.max_write_bytes < 4096:
            fail("options.max_write_bytes", self.max_write_bytes, "must be at least 4096")
        if self.staging_bytes < 0:
            fail("options.staging_bytes", self.staging_bytes, "must be >= 0 (0 disables staging)")
        _bandwidth("options.pack_gbps", self.pack_gbps)
        for name in ("write_overhead_us", "pack_overhead_us"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= MAX_OVERHEAD_US):
                fail(f"options.{name}", value, f"must be a number of microseconds in [0, "
                      f"{MAX_OVERHEAD_US:g}]")


@dataclass(frozen=True, slots=True)
class Config:
    model: ModelConfig
    """The model: its HF config.json and overrides."""
    source: SourceConfig
    """The training side's layout."""
    target: TargetConfig
    """The inference side's layout."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Hosts, GPUs, NICs and where ranks sit."""
    options: Options = field(default_factory=Options)
    """Compiler options."""
    base_dir: str = "."
    """Folder relative paths are resolved against (the YAML file's folder; not a YAML key)."""

    def __post_init__(self) -> None:
        if isinstance(path := self.target.placement, str):  # a file beside the config
            placement = load_placement(os.path.normpath(os.path.join(self.base_dir, path)))
            object.__setattr__(self, "target", _replace(self.target, placement=placement))

    @property
    def model_config_path(self) -> str:
        return os.path.normpath(os.path.join(self.base_dir, self.model.config))


# ---------------------------------------------------------------- loading from plain data

SECTIONS = {"model": ModelConfig, "source": SourceConfig, "target": TargetConfig,
             "cluster": ClusterConfig, "options": Options}

