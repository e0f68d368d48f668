"""The compile config: what model moves, from which layout, to which, over which cluster.

A config is a YAML file with five sections (`model`, `source`, `target`, `cluster`,
`options`). Each section is a frozen dataclass below, with a docstring under every field.
Checks of one section live in its `__post_init__`; checks that span sections (world size
against the cluster, tp against the model's heads) live in `planner/validate.py`, because
they need the model spec.

Every error is a `ConfigError` naming the full key, the bad value and the fix.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from .errors import UserError

DTYPES = ("bfloat16", "float16", "float32")


class ConfigError(UserError):
    """A config value a user got wrong. The message names the key, the value and the fix."""


def _fail(key: str, value: object, fix: str) -> None:
    raise ConfigError(f"{key}: {value!r} {fix}")


def _positive(section: str, name: str, value: int | None) -> None:
    if value is not None and value < 1:
        _fail(f"{section}.{name}", value, "must be a positive integer (>= 1)")


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
            _fail("model.config", self.config, "must be the path to a HF config.json")
        _positive("model", "num_layers", self.num_layers)


@dataclass(frozen=True, slots=True)
class SourceConfig:
    framework: Literal["megatron", "fsdp2"]
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
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the training weights; a cast is planned where the target dtype differs."""
    vocab_padding: Literal["megatron", "none"] = "megatron"
    """megatron: pad the vocab to a multiple of 128*tp (Megatron-LM) or not at all (Bridge)."""
    transformer_engine: bool = False
    """megatron: names with Transformer Engine's fused norms (`linear_qkv.layer_norm_weight`)."""
    expert_layout: Literal["grouped", "sequential"] = "grouped"
    """megatron: `experts.linear_fc1.weight{i}` (grouped) or `experts.local_experts.{i}.*`."""
    pp_first_stage_layers: int | None = None
    """megatron: layers on the first PP stage; the rest spread evenly (None: even split)."""
    pp_last_stage_layers: int | None = None
    """megatron: layers on the last PP stage; the rest spread evenly (None: even split)."""
    fused_experts: bool = False
    """fsdp2: experts as transformers 5.x fused `experts.gate_up_proj [E,2I,H]` params."""

    def __post_init__(self) -> None:
        if self.framework not in ("megatron", "fsdp2"):
            _fail("source.framework", self.framework, "is not supported; use megatron or fsdp2")
        for name in ("tp", "pp", "dp", "dp_replicate", "ep", "etp"):
            _positive("source", name, getattr(self, name))
        for name in ("pp_first_stage_layers", "pp_last_stage_layers"):
            _positive("source", name, getattr(self, name))
        if self.dtype not in DTYPES:
            _fail("source.dtype", self.dtype, f"is not supported; use one of {', '.join(DTYPES)}")
        if self.framework == "fsdp2":
            for name in ("pp", "ep", "etp"):
                value = getattr(self, name)
                if value not in (None, 1):
                    _fail(f"source.{name}", value, "is megatron-only; remove it for fsdp2")
        elif self.dp_replicate != 1:
            _fail("source.dp_replicate", self.dp_replicate,
                  "is fsdp2-only (HSDP); use source.dp for Megatron data parallel")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world(self) -> int:
        if self.framework == "fsdp2":
            return self.tp * self.dp * self.dp_replicate
        return self.tp * self.pp * self.dp


@dataclass(frozen=True, slots=True)
class TargetConfig:
    engine: Literal["vllm", "sglang"]
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
    dtype: Literal["bfloat16", "float16", "float32", "fp8_block128"] = "bfloat16"
    """dtype of the inference weights; `fp8_block128`: linear weights as e4m3 in 128x128
    blocks with float32 `weight_scale_inv` (quantized on the sources), the rest bf16."""
    expert_names: Literal["routed_experts", "experts"] = "routed_experts"
    """vllm: `experts.routed_experts.w13_weight` (0.33) or the older `experts.w13_weight`."""
    dp_attention: bool = False
    """sglang: DP attention (attention weights use attn_tp = tp/dp; world = tp)."""
    w13_order: Literal["w1w3", "w3w1"] = "w1w3"
    """vllm MoE `w13_weight` row order per expert: `w1w3` ([gate; up], the loader's and
    Triton's) or `w3w1` ([up; gate], what FlashInfer-CUTLASS keeps after loading)."""

    def __post_init__(self) -> None:
        if self.engine not in ("vllm", "sglang"):
            _fail("target.engine", self.engine, "is not supported; use vllm or sglang")
        for name in ("tp", "dp", "pp", "replicas"):
            _positive("target", name, getattr(self, name))
        if self.dtype not in (*DTYPES, "fp8_block128"):
            _fail("target.dtype", self.dtype,
                  f"is not supported; use one of {', '.join(DTYPES)}, fp8_block128")
        if self.dp_attention and self.engine != "sglang":
            _fail("target.dp_attention", True, "is sglang-only; remove it for vllm")
        if self.w13_order not in ("w1w3", "w3w1"):
            _fail("target.w13_order", self.w13_order, "is not supported; use w1w3 or w3w1")
        if self.w13_order != "w1w3" and self.engine != "vllm":
            _fail("target.w13_order", self.w13_order, "is vllm-only; remove it")

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
        for name in ("nic_gbps", "nvlink_gbps"):
            if getattr(self, name) <= 0:
                _fail(f"cluster.{name}", getattr(self, name), "must be a positive bandwidth")
        if self.placement not in ("disaggregated", "colocated"):
            _fail("cluster.placement", self.placement, "must be disaggregated or colocated")
        if self.gpus_per_host % self.nics_per_host and self.nic_gpus is None:
            _fail("cluster.nics_per_host", self.nics_per_host,
                  f"must divide gpus_per_host={self.gpus_per_host}, or give cluster.nic_gpus")
        if self.source_gpus_per_host is not None:
            if self.placement != "colocated":
                _fail("cluster.source_gpus_per_host", self.source_gpus_per_host,
                      "is only used with placement: colocated; remove it")
            if self.source_gpus_per_host >= self.gpus_per_host:
                _fail("cluster.source_gpus_per_host", self.source_gpus_per_host,
                      f"must leave target GPUs: use fewer than gpus_per_host={self.gpus_per_host}")
        if self.nic_gpus is not None:
            if len(self.nic_gpus) != self.nics_per_host:
                _fail("cluster.nic_gpus", self.nic_gpus,
                      f"must list one GPU list for each of the {self.nics_per_host} NICs")
            seen = sorted(g for gpus in self.nic_gpus for g in gpus)
            if seen != list(range(self.gpus_per_host)):
                _fail("cluster.nic_gpus", self.nic_gpus,
                      f"must give every GPU 0..{self.gpus_per_host - 1} exactly one NIC")


@dataclass(frozen=True, slots=True)
class Options:
    max_write_bytes: int = 64 << 20
    """Largest single RDMA write; longer runs are split."""
    staging_bytes: int = 256 << 20
    """Staging memory budget per rank (pack/cast on sources, unpack on targets)."""
    write_overhead_us: float = 2.0
    """Cost model: fixed cost of one write (posting, completion), in microseconds."""
    pack_gbps: float = 2000.0
    """Cost model: throughput of a local strided pack/unpack/cast, in Gb/s."""
    pack_overhead_us: float = 10.0
    """Cost model: fixed cost of one pack or unpack (a kernel launch), in microseconds."""

    def __post_init__(self) -> None:
        if self.max_write_bytes < 4096:
            _fail("options.max_write_bytes", self.max_write_bytes, "must be at least 4096")
        if self.staging_bytes < 0:
            _fail("options.staging_bytes", self.staging_bytes, "must be >= 0 (0 disables staging)")
        for name in ("write_overhead_us", "pack_gbps", "pack_overhead_us"):
            if getattr(self, name) < 0:
                _fail(f"options.{name}", getattr(self, name), "must be >= 0")


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

    @property
    def model_config_path(self) -> str:
        return os.path.normpath(os.path.join(self.base_dir, self.model.config))


# ---------------------------------------------------------------- loading from plain data

_SECTIONS = {"model": ModelConfig, "source": SourceConfig, "target": TargetConfig,
             "cluster": ClusterConfig, "options": Options}


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is tuple:
        return "a list"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; convert lists to tuples, ints to floats."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        _fail(key, value, "has the wrong type: expected " +
              " or ".join(_type_name(a) for a in args))
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            _fail(key, value, f"is not one of {', '.join(map(repr, args))}{hint}")
        return value
    if origin is tuple:
        pairs = bool(args) and typing.get_origin(args[0]) is tuple and \
            typing.get_args(args[0])[-1] is not Ellipsis  # tuple[tuple[str, X], ...]
        if pairs:
            if not isinstance(value, dict):
                _fail(key, value, "has the wrong type: expected a mapping (key: value)")
            return tuple((str(k), v) for k, v in value.items())
        if not isinstance(value, (list, tuple)):
            _fail(key, value, "has the wrong type: expected a list")
        item = args[0] if args else Any
        return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            _fail(key, value, "has the wrong type: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, value, "has the wrong type: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(key, value, "has the wrong type: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(key, value, "has the wrong type: expected a string")
        return value
    if isinstance(value, tp):
        return value
    _fail(key, value, f"has the wrong type: expected {_type_name(tp)}")


def _section(name: str, cls: type, data: Any) -> Any:
    if data is None:  # `options:` with nothing under it
        data = {}
    if not isinstance(data, dict):
        _fail(name, data, "must be a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), 1)
            hint = f"did you mean {name}.{close[0]}?" if close else \
                f"known keys: {', '.join(known)}"
            raise ConfigError(f"{name}.{key}: unknown key; {hint}")
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    for f in known.values():
        if f.default is MISSING and f.default_factory is MISSING and f.name not in kwargs:
            raise ConfigError(f"{name}.{f.name}: missing; this key is required")
    return cls(**kwargs)


def config_from_dict(data: Any, base_dir: str = ".") -> Config:
    """Build a `Config` from plain data (a parsed YAML document)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: {type(data).__name__} at the top level; the file must be "
                          "a mapping with model, source, target, cluster, options")
    for key in data:
        if key not in _SECTIONS:
            close = difflib.get_close_matches(str(key), list(_SECTIONS), 1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(_SECTIONS)}"
            raise ConfigError(f"{key}: unknown section; {hint}")
    for key in ("model", "source", "target"):
        if key not in data:
            raise ConfigError(f"{key}: missing; the config needs a {key} section")
    built = {name: _section(name, cls, data[name]) for name, cls in _SECTIONS.items()
             if name in data}
    return Config(**built, base_dir=base_dir)


def load_config(path: str) -> Config:
    """Read a YAML config with `yaml.safe_load` and check each section."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file: {path!r} does not exist; give the path to a "
                          "YAML config") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file: {path!r} is not valid YAML{where}: {problem}; "
                          "fix the syntax there") from None
    return config_from_dict(data, base_dir=os.path.dirname(os.path.abspath(path)))
