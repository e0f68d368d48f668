"""The framework registry (planner/frameworks.py): one complete record per framework and
engine the schemas allow (`schemas.config.SOURCES`, `TARGETS`: the one list of names, which
`schemas.identity.KEYS` and the registry follow or refuse to import), each caller dispatching
through it, a one-line refusal otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import typing

import pytest

from planner import frameworks
from planner.derived import derived
from planner.frameworks import build_layout
from planner.identities import rank_identities
from planner.passes.emit import source_replicated
from planner.spec import spec_from_hf
from planner.validate import layout_check
from schemas.config import (
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
from schemas.identity import KEYS, check_identity

QWEN3 = dict(model_type="qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             head_dim=128, intermediate_size=512, vocab_size=101, num_hidden_layers=2,
             tie_word_embeddings=False)
MLA = dict(model_type="deepseek_v3", hidden_size=256, vocab_size=300, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128,
           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=256,
           moe_intermediate_size=256, n_routed_experts=4, n_shared_experts=1,
           num_experts_per_tok=2, first_k_dense_replace=1, tie_word_embeddings=False)


def _allowed(cls: type, field: str) -> tuple[str, ...]:
    return typing.get_args(typing.get_type_hints(cls)[field])


def test_every_allowed_framework_and_engine_has_a_complete_record() -> None:
    sources, targets = _allowed(SourceConfig, "framework"), _allowed(TargetConfig, "engine")
    assert sources == SOURCES and targets == TARGETS
    assert list(frameworks.FRAMEWORKS) == [*sources, *targets] == list(KEYS)
    for name, fw in frameworks.FRAMEWORKS.items():
        assert fw.name == name
        assert fw.side == ("source" if name in sources else "target")
        for part in ("check", "layout", "identity", "derived", "traces"):
            assert callable(getattr(fw, part)), f"{name}.{part}"


@pytest.mark.parametrize("module, lists", [("schemas.identity", "schemas.identity.KEYS"),
                                           ("planner.frameworks", "planner.frameworks has")])
@pytest.mark.parametrize("side", ["SOURCES", "TARGETS"])
def test_a_name_added_to_the_config_alone_is_refused_at_import(module: str, lists: str,
                                                                side: str) -> None:
    """A framework or engine added to `schemas.config` without its identity coordinates or
    its registry record stops the import with a line naming both lists."""
    code = (f"import schemas.config as c; c.{side} = (*c.{side}, 'newfw'); import {module}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and lists in last and "newfw" in last, last


def test_a_bad_name_in_a_config_is_refused_naming_the_one_list() -> None:
    with pytest.raises(ConfigError, match=r"^source\.framework: 'deepspeed' is not supported; "
                                          r"use megatron or fsdp2$"):
        SourceConfig("deepspeed")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^target\.engine: 'trtllm' is not supported; "
                                          r"use vllm or sglang$"):
        TargetConfig("trtllm")  # type: ignore[arg-type]


@pytest.mark.parametrize("side", [SourceConfig("megatron", tp=2, pp=2),
                                  SourceConfig("fsdp2", tp=2, dp=2),
                                  TargetConfig("vllm", tp=2, replicas=2),
                                  TargetConfig("sglang", tp=2, pp=2)])
def test_each_record_builds_checks_and_identifies_its_ranks(
        side: SourceConfig | TargetConfig) -> None:
    spec = spec_from_hf(QWEN3, mtp=False)
    fw = frameworks.of(side)
    assert layout_check(side, spec) is fw.check
    fw.check(spec, side)
    layout = build_layout(spec, side)
    assert layout.framework == fw.name and layout.world == side.world
    idents = [check_identity(fw.identity(side, r)) for r in range(layout.world)]
    assert {i["framework"] for i in idents} == {fw.name}
    assert len({tuple(sorted(i.items())) for i in idents}) == layout.world  # all distinct
    assert all(fw.derived(r) == [] for r in layout.ranks)  # bf16 Qwen3: nothing derived


def test_identities_and_derived_come_from_the_records() -> None:
    spec = spec_from_hf(MLA, mtp=False)
    cfg = Config(model=ModelConfig("unused"), source=SourceConfig("fsdp2", dp=2),
                 target=TargetConfig("sglang", tp=2), cluster=ClusterConfig(gpus_per_host=8),
                 options=Options())
    src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    idents = rank_identities(cfg, src, dst)["identities"]
    assert idents == ([frameworks.get("fsdp2").identity(cfg.source, r) for r in range(2)]
                      + [frameworks.get("sglang").identity(cfg.target, r) for r in range(2)])
    d = derived(dst, 2, cfg.target)
    assert d[:2] == [[], []] and all(e and e[0]["engine"] == "sglang" for e in d[2:])


@pytest.mark.parametrize("name, key, side, allowed", [
    ("deepspeed", "source.framework", "source", "megatron, fsdp2"),
    ("vllm", "source.framework", "source", "megatron, fsdp2"),
    ("trtllm", "target.engine", "target", "vllm, sglang"),
    ("trtllm", "framework", None, "megatron, fsdp2, vllm, sglang"),
    (None, "target.engine", "target", "vllm, sglang"),
])
def test_an_unknown_name_is_refused_in_one_line(name: object, key: str, side: str | None,
                                                allowed: str) -> None:
    with pytest.raises(ConfigError) as e:
        frameworks.get(name, key, side)  # type: ignore[arg-type]
    assert str(e.value) == f"{key}: {name!r} is not one of {allowed}"


@pytest.mark.parametrize("side", [
    SourceConfig("megatron"), SourceConfig("megatron", dp=4), SourceConfig("megatron", tp=2),
    SourceConfig("megatron", pp=2), SourceConfig("megatron", ep=2, dp=2),
    SourceConfig("megatron", tp=2, etp=1, ep=2), SourceConfig("fsdp2"),
    SourceConfig("fsdp2", dp=2), SourceConfig("fsdp2", tp=2),
    SourceConfig("fsdp2", dp=1, dp_replicate=3)])
def test_replicated_says_whether_every_rank_holds_the_whole_model(side: SourceConfig) -> None:
    spec = spec_from_hf(dict(MLA, num_hidden_layers=2), mtp=False)
    layout = build_layout(spec, side)
    total = sum(t.numel for t in spec.tensors)
    whole = all(sum(p.numel for t in r.tensors for p in t.pieces) >= total
                for r in layout.ranks)
    assert frameworks.of(side).replicated(side) is whole
    assert source_replicated(side) is whole
