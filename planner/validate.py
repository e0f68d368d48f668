"""`load` (YAML + spec + checks) and `validate`: a config against its model, all at once.

`schemas.config` checks each section alone. The rules that need the model spec live in
each layout module's `check(spec, cfg)` (`planner/layouts/{megatron,fsdp2,vllm,sglang}.py`,
the only home of each rule, reached through `planner/frameworks.py`); the rule that world
sizes fit `cluster.hosts` lives in `planner.topology.build_topology`. `validate` runs them
all and reports every error it finds, not only the first (`schemas.errors.ConfigErrors`).
One rule is its own here: a dense model takes no expert keys (the layouts would ignore
them; a user meant something).
"""

from __future__ import annotations

from collections.abc import Callable

from planner import frameworks
from planner.spec import ModelSpec, load_spec
from planner.topology import build_topology
from schemas.config import Config, SourceConfig, TargetConfig
from schemas.errors import ConfigError, check_each


def load(config_path: str) -> tuple[Config, ModelSpec]:
    """Read a YAML config and its model's config.json, and check them together."""
    from schemas.config_load import load_config

    cfg = load_config(config_path)
    spec = load_spec(cfg.model_config_path, cfg.model.num_layers, cfg.model.overrides,
                     cfg.model.mtp)
    validate(cfg, spec)
    return cfg, spec


def layout_check(side: SourceConfig | TargetConfig,
                 spec: ModelSpec) -> Callable[[ModelSpec, object], None]:
    """The `check(spec, cfg)` of the framework or engine that builds `side`
    (`planner/frameworks.py`; a traced vLLM target runs `planner.layouts.traced.check`)."""
    return frameworks.of(side).check


def validate(config: Config, spec: ModelSpec) -> None:
    """Raise `ConfigError` (`ConfigErrors` for several) on every rule `config` breaks."""
    check_each(lambda: _no_experts_on_dense_model(config, spec),
               lambda: layout_check(config.source, spec)(spec, config.source),
               lambda: layout_check(config.target, spec)(spec, config.target),
               lambda: build_topology(config.cluster, config.source.world,
                                      config.target.world))


def _no_experts_on_dense_model(config: Config, spec: ModelSpec) -> None:
    if spec.dims.num_experts:
        return
    s, t = config.source, config.target
    for key, value, set_ in (("source.ep", s.ep, s.ep != 1),
                             ("source.etp", s.etp, s.etp not in (None, s.tp)),
                             ("target.ep", t.ep, t.ep)):
        if set_:
            raise ConfigError(f"{key}: {value!r} is set but the model is dense (no experts); "
                              "remove it")
