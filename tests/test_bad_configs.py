"""Bad configs fail at validation with one line naming the key, the value and the fix.

Each YAML in tests/bad_configs/ breaks one rule; `rdma-plan compile CASE -o OUT` must
exit 2 and print exactly one line `rdma-plan: error: ...` holding the substrings below
(the full key, the bad value, the fix), and never a traceback. The good configs next to
them (plans/demo.yaml) load, so the failures come from the rule each case breaks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main
from planner.topology import build_topology
from planner.validate import load

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "tests" / "bad_configs"

# case -> substrings of its one-line error (key, value, fix).
EXPECTED: dict[str, tuple[str, ...]] = {
    "yaml_syntax": ("config file:", "not valid YAML", "line 4", "fix the syntax"),
    "top_level_list": ("config: list at the top level", "must be a mapping"),
    "missing_section": ("target: missing", "needs a target section"),
    "missing_key": ("source.framework: missing", "required"),
    "unknown_key": ("source.tpp: unknown key", "did you mean source.tp?"),
    "unknown_section": ("optons: unknown section", "did you mean options?"),
    "wrong_type": ("source.tp: 'two'", "expected an integer"),
    "float_for_int": ("target.tp: 2.0", "expected an integer"),
    "bad_literal": ("target.engine: 'vlm'", "did you mean 'vllm'?"),
    "bad_dtype": ("source.dtype: 'bf16'", "did you mean 'bfloat16'?"),
    "negative_tp": ("source.tp: -2", "positive integer"),
    "tp_not_dividing_heads": ("source.tp: 3", "num_attention_heads=8", "use one of 1, 2, 4, 8"),
    "target_tp_kv_groups": ("target.tp: 6", "num_key_value_heads=4", "multiple of it"),
    "intermediate_not_divisible": ("source.tp: 4", "intermediate_size=510", "use one of"),
    "vocab_not_divisible": ("source.tp: 2", "vocab_size=1001", "vocab_padding: megatron"),
    "mla_kv_down_tp": ("source.tp: 4", "kv_lora_rank + qk_rope_head_dim=82",
                       "source.transformer_engine: true"),
    "pp_more_than_layers": ("source.pp: 8", "4 layers", "at most 4"),
    "pp_not_dividing_layers": ("source.pp: 3", "4 layers", "use one of 1, 2, 4"),
    "experts_not_divisible_by_ep": ("source.ep: 3", "routed experts=8", "use one of 1, 2, 4, 8"),
    "moe_intermediate_etp": ("source.etp: 8", "moe_intermediate_size=100", "use one of"),
    "ep_on_dense_model": ("source.ep: 2", "dense", "remove it"),
    "target_ep_on_dense_model": ("target.ep: True", "dense", "remove it"),
    "fsdp2_with_pp": ("source.pp: 2", "megatron-only", "remove it"),
    "dp_attention_on_vllm": ("target.dp_attention: True", "sglang-only", "remove it"),
    "dp_attention_tp_dp": ("target.dp: 3", "must divide target.tp=4"),
    "hosts_mismatch": ("cluster.hosts: 3", "need 2 hosts", "set cluster.hosts: 2"),
    "hosts_mismatch_colocated": ("cluster.hosts: 1", "colocated", "set cluster.hosts: 2"),
    "source_gpus_without_colocated": ("cluster.source_gpus_per_host: 2", "colocated",
                                      "remove it"),
    "nic_gpus_wrong": ("cluster.nic_gpus:", "every GPU 0..3 exactly one NIC"),
    "nics_not_dividing_gpus": ("cluster.nics_per_host: 3", "must divide gpus_per_host=8"),
    "zero_bandwidth": ("cluster.nic_gbps: 0", "positive bandwidth"),
    "max_write_bytes_too_small": ("options.max_write_bytes: 1024", "at least 4096"),
    "negative_staging": ("options.staging_bytes: -1", ">= 0"),
    "unknown_model_type": ("model.config:", "'gpt2' is not supported", "supported: llama"),
    "negative_hidden_size": ("model.config:", "hidden_size = -256", "model.overrides"),
    "missing_config_json": ("model.config:", "models/nope/config.json", "does not exist"),
    "config_json_not_json": ("model.config:", "not-json/config.json", "not valid JSON"),
    "config_json_missing_key": ("model.config:", "'hidden_size' is missing", "add it"),
    "num_layers_zero": ("model.num_layers: 0", "positive integer"),
    "overrides_not_mapping": ("model.overrides: ['hidden_size', 256]", "expected a mapping"),
    "override_typo": ("model.overrides.hiden_size", "did you mean hidden_size?"),
    "override_wrong_type": ("model.overrides.hidden_size: 'big'", "must be an integer"),
    "config_json_wrong_type": ("model.config: num_attention_heads: '8'", "must be an integer",
                               "fix config.json"),
    "zero_replicas": ("target.replicas: 0", "positive integer"),
    "placement_typo": ("cluster.placement: 'colocate'", "did you mean 'colocated'?"),
    "empty_file": ("config: NoneType at the top level", "must be a mapping"),
}


def test_every_case_file_is_in_the_table() -> None:
    assert sorted(p.stem for p in CASES.glob("*.yaml")) == sorted(EXPECTED)
    assert len(EXPECTED) >= 25


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_config_fails_with_one_line(case: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.rplan"
    code = main(["compile", str(CASES / f"{case}.yaml"), "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("rdma-plan: error: ")
    assert len(lines[0]) < 300
    for part in EXPECTED[case]:
        assert part in lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert not out.exists()


def test_subprocess_prints_no_traceback(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "planner", "compile",
                          str(CASES / "tp_not_dividing_heads.yaml"), "-o",
                          str(tmp_path / "plan.rplan")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == ("rdma-plan: error: source.tp: 3 must divide "
                                  "num_attention_heads=8; use one of 1, 2, 4, 8")
    assert "Traceback" not in run.stderr + run.stdout


def test_missing_yaml_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["compile", str(tmp_path / "absent.yaml"), "-o", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "config file:" in err and "does not exist" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["compile", str(ROOT / "plans/demo.yaml")]) == 2  # no -o
    assert "-o" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_demo_config_is_valid() -> None:
    cfg, spec = load(str(ROOT / "plans/demo.yaml"))
    # colocated, 4 GPUs per host, 2 for sources: megatron tp 2 (2 GPUs) and vLLM tp 1 x 2
    # replicas (2 GPUs) fit on one host.
    hosts = build_topology(cfg.cluster, cfg.source.world, cfg.target.world).hosts
    assert (cfg.source.world, cfg.target.world, hosts) == (2, 2, 1)
    assert spec.dims.model_type == "qwen3" and spec.dims.num_layers == 4


@pytest.mark.parametrize("placement, src_per_host, expected", [
    # disaggregated: ceil(12/8) source hosts + ceil(20/8) target hosts = 2 + 3
    ("disaggregated", None, 5),
    # colocated, default half: ceil(12/4)=3 vs ceil(20/4)=5 -> 5 hosts
    ("colocated", None, 5),
    # colocated, 2 source GPUs per host: ceil(12/2)=6 vs ceil(20/6)=4 -> 6 hosts
    ("colocated", 2, 6),
])
def test_needed_hosts(placement: str, src_per_host: int | None, expected: int) -> None:
    from schemas.config import config_from_dict

    cluster = {"placement": placement, "gpus_per_host": 8}
    if src_per_host is not None:
        cluster["source_gpus_per_host"] = src_per_host
    cfg = config_from_dict({"model": {"config": "x"},
                            "source": {"framework": "megatron", "tp": 4, "dp": 3},
                            "target": {"engine": "vllm", "tp": 4, "replicas": 5},
                            "cluster": cluster})
    assert build_topology(cfg.cluster, cfg.source.world, cfg.target.world).hosts == expected


def test_docs_list_every_key() -> None:
    from dataclasses import fields

    from schemas.config import _SECTIONS

    doc = (ROOT / "docs" / "config.md").read_text()
    missing = [f"{sec}.{f.name}" for sec, cls in _SECTIONS.items() for f in fields(cls)
               if f"`{sec}.{f.name}`" not in doc]
    assert missing == []
