"""Bad configs fail at validation with one line naming the key, the value and the fix.

Each YAML in tests/bad_configs/ breaks one rule; `rdma-plan compile CASE -o OUT` must
exit 2 and print exactly one line `rdma-plan: error: ...` holding the substrings below
(the full key, the bad value, the fix), and never a traceback. The good configs next to
them (plans/demo.yaml) load, so the failures come from the rule each case breaks.

`hostile_*` cases are what an attacker (or a bad day) hands the compiler: alias bombs,
deep nesting, huge numbers, NaN/inf, /dev/zero, a world of 10^5 ranks, 10^6 layers. Each
must be refused the same way, in under 5 s and without growing the process past 1 GiB;
the big ones (a 100 MB YAML, a FIFO) are generated in a tmp dir by the tests below.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from planner.cli import main
from planner.topology import build_topology
from planner.validate import load
from tests.support.clock import cpu_seconds

ROOT = Path(__file__).resolve().parents[2]
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
    "unknown_model_type": ("model.config:", "'not_a_model' is not supported",
                           "transformers does not know it", "hand-written: llama"),
    "no_layout_rules": ("target.engine: 'vllm'", "no layout rules for model_type 'gpt2'",
                        "rules for llama"),
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
    # ---- hostile: YAML structure
    "hostile_alias_bomb": ("config file:", "expands to more than 100,000 nodes", "aliases"),
    "hostile_alias_bomb_top": ("config file:", "expands to more than 100,000 nodes"),
    "hostile_deep_nesting": ("config file:", "nests deeper than 32 levels"),
    "hostile_deep_mapping": ("config file:", "nests deeper than 32 levels"),
    "hostile_long_scalar": ("config file:", "holds a value of 5,000 characters", "at most 4096"),
    "hostile_int_5000_digits": ("config file:", "line 5", "5,000 characters"),
    "hostile_python_tag": ("config file:", "not valid YAML", "python/object/apply:os.system"),
    "hostile_binary_tp": ("source.tp: b'hello'", "expected an integer"),
    "hostile_two_documents": ("config file:", "not valid YAML", "another document"),
    "hostile_unhashable_key": ("config file:", "not valid YAML", "unhashable key"),
    "hostile_yaml_not_utf8": ("config file:", "is not UTF-8 text", "a YAML config"),
    "hostile_long_key": ("source.'xxxxxxxx", "...>: unknown key"),
    "hostile_section_is_string": ("source: 'megatron'", "must be a mapping"),
    "hostile_top_level_string": ("config: str at the top level", "must be a mapping"),
    "hostile_bool_for_tp": ("source.tp: True", "expected an integer"),
    "hostile_mtp_string": ("model.mtp: 'yes'", "expected true or false"),
    # ---- hostile: numbers
    "hostile_huge_int_tp": ("source.tp: 1000000000000000000000000000000", "too large",
                            "2**53"),
    "hostile_huge_int_staging": ("options.staging_bytes: 1152921504606846976", "too large"),
    "hostile_huge_max_write": ("options.max_write_bytes: 100000000000000000000", "too large"),
    "hostile_nan_nic_gbps": ("cluster.nic_gbps: nan", "finite number"),
    "hostile_inf_nic_gbps": ("cluster.nic_gbps: inf", "finite number"),
    "hostile_neg_inf_nvlink": ("cluster.nvlink_gbps: -inf", "finite number"),
    "hostile_float_overflow": ("cluster.nic_gbps: inf", "finite number"),
    "hostile_negative_nvlink": ("cluster.nvlink_gbps: -5.0", "positive bandwidth"),
    "hostile_zero_pack_gbps": ("options.pack_gbps: 0.0", "positive bandwidth"),
    "hostile_nan_pack_overhead": ("options.pack_overhead_us: nan", "finite number"),
    "hostile_inf_write_overhead": ("options.write_overhead_us: inf", "finite number"),
    "hostile_hosts_huge": ("cluster.hosts: 1000000000000000", "need 2 hosts",
                           "set cluster.hosts: 2"),
    # ---- hostile: sizes (layers, tensors, ranks, GPUs)
    "hostile_million_layers": ("model.num_layers: 1000000", "more than 1024 layers"),
    "hostile_override_million_layers": ("model.overrides.num_hidden_layers: 1000000",
                                        "more than 1,024"),
    "hostile_override_huge_hidden": ("model.overrides.hidden_size: 1000000000000",
                                     "more than 16,777,216"),
    "hostile_override_huge_vocab": ("model.overrides.vocab_size: 1099511627776", "more than"),
    "hostile_override_nan": ("model.overrides.hidden_size: nan", "must be an integer"),
    "hostile_too_many_tensors": ("model.config:", "1000 layers of 100000 experts",
                                 "more than 1,000,000 tensors"),
    "hostile_mtp_million": ("model.overrides.num_nextn_predict_layers: 1000000", "more than"),
    "hostile_world_source": ("source.tp * source.pp * source.dp: 100,000 ranks",
                             "more than the 16384"),
    "hostile_world_target": ("target.tp * target.dp * target.pp * target.replicas: 200,000",
                             "more than the 16384"),
    "hostile_world_fsdp2": ("source.tp * source.dp * source.dp_replicate: 100,000 ranks",),
    "hostile_gpus_per_host": ("cluster.gpus_per_host: 1000000000000", "more than 1024"),
    "hostile_colocated_one_gpu": ("cluster.gpus_per_host: 1", "at least 2", "colocated"),
    # ---- hostile: the model's config.json
    "hostile_config_dev_zero": ("model.config: '/dev/zero'", "not a regular file"),
    "hostile_config_folder_without_json": ("model.config:", "plans/config.json",
                                           "does not exist"),
    "hostile_config_is_yaml": ("model.config:", "negative_tp.yaml", "not valid JSON"),
    "hostile_json_nan": ("model.config:", "nan/config.json", "NaN"),
    "hostile_json_huge_int": ("model.config: hidden_size: 1000000000000000000000000000000",
                              "more than 16,777,216", "fix config.json"),
    "hostile_json_deep": ("model.config:", "deep/config.json", "nests too deeply"),
    "hostile_json_list": ("model.config:", "holds list, not a JSON object"),
    "hostile_json_not_utf8": ("model.config:", "not UTF-8 text"),
    "hostile_json_mlp_only_layers": ("model.config: mlp_only_layers",
                                     "must be a list of layer indices"),
    "hostile_json_zero_heads": ("model.config: num_attention_heads = 0", "must be positive"),
}
MAX_CPU_SECONDS = 5.0
"""A bad config is refused cheaply: at most this much CPU time of this process (the slowest
case takes about 1 s on a quiet box; CPU time does not grow when the box is busy)."""
IMPORTS_TORCH = {"no_layout_rules"}
"""Cases whose spec comes from transformers on the meta device: they import torch and
transformers first, so only a generous ceiling applies."""
MAX_RSS = 1 << 30


def test_every_case_file_is_in_the_table() -> None:
    assert sorted(p.stem for p in CASES.glob("*.yaml")) == sorted(EXPECTED)
    assert len(EXPECTED) >= 80


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_config_fails_with_one_line(case: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    _fails_with_one_line(str(CASES / f"{case}.yaml"), EXPECTED[case], tmp_path, capsys,
                         max_cpu_s=120.0 if case in IMPORTS_TORCH else MAX_CPU_SECONDS)


def _fails_with_one_line(config: str, parts: tuple[str, ...], tmp_path: Path,
                         capsys: pytest.CaptureFixture, max_cpu_s: float = MAX_CPU_SECONDS) -> str:
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "plan.rplan"
    tracemalloc.start()  # this case's own peak (the process's max RSS holds earlier tests')
    t0 = cpu_seconds()
    try:
        code = main(["compile", config, "-o", str(out)])
    finally:
        cpu_s = cpu_seconds() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("rdma-plan: error: ")
    assert len(lines[0]) < 300
    for part in parts:
        assert part in lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert os.listdir(tmp_path / "out") == []  # no plan, no temporary file
    # bounded work: a ceiling on CPU seconds, not a timing benchmark
    assert cpu_s < max_cpu_s, f"{config}: {cpu_s:.1f} CPU s to refuse (ceiling {max_cpu_s})"
    assert peak < MAX_RSS
    return lines[0]


# ---------------------------------------------------------------- hostile files made here

def _yaml(tmp_path: Path, name: str, model_config: str = "", extra: str = "") -> Path:
    model = model_config or str(ROOT / "plans/models/tiny-qwen3/config.json")
    path = tmp_path / "in" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"model:\n  config: {model}\nsource:\n  framework: megatron\n"
                    f"target:\n  engine: vllm\n{extra}")
    return path


def test_hostile_100mb_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _yaml(tmp_path, "big.yaml")
    with open(path, "a") as f:  # a comment of 100 MB after a valid config
        f.write("#" + "x" * (100 << 20) + "\n")
    _fails_with_one_line(str(path), ("config file:", "104,857,7", "more than the 1,048,576"),
                         tmp_path, capsys)


def test_hostile_2mb_config_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    hf = tmp_path / "in" / "config.json"
    hf.parent.mkdir()
    hf.write_text('{"model_type": "qwen3", "pad": "' + "x" * (2 << 20) + '"}')
    _fails_with_one_line(str(_yaml(tmp_path, "c.yaml", str(hf))),
                         ("model.config:", "2,097,1", "more than the 1,048,576"),
                         tmp_path, capsys)


@pytest.mark.parametrize("what", ["model_config", "yaml"])
def test_hostile_fifo(what: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # Opening a FIFO for reading blocks until a writer comes: it must be refused unopened.
    fifo = tmp_path / "in" / "fifo"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    config = _yaml(tmp_path, "c.yaml", str(fifo)) if what == "model_config" else fifo
    key = "model.config:" if what == "model_config" else "config file:"
    _fails_with_one_line(str(config), (key, "is not a regular file"), tmp_path, capsys)


def test_hostile_dev_zero_as_the_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    link = tmp_path / "in" / "zero.yaml"
    link.parent.mkdir()
    link.symlink_to("/dev/zero")
    _fails_with_one_line(str(link), ("config file:", "is not a regular file"),
                         tmp_path, capsys)


def test_hostile_many_errors_are_capped(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # 10,000 unknown keys: ten errors and a count, not 10,000 lines.
    keys = "".join(f"  k{i}: 1\n" for i in range(10_000))
    path = _yaml(tmp_path, "many.yaml", extra=f"options:\n{keys}")
    assert main(["compile", str(path), "-o", str(tmp_path / "p")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 11
    assert all(line.startswith("rdma-plan: error: options.k") for line in lines[:10])
    assert lines[10] == "rdma-plan: error: ... and 9990 more errors; fix these first"


def test_hostile_cases_in_a_fresh_process_stay_small(tmp_path: Path) -> None:
    # The alias bomb and the 10^5-rank world in a process of their own: peak RSS < 1 GiB.
    # The child reports its own peak (VmHWM of its address space): RUSAGE_CHILDREN holds
    # earlier tests' children and ru_maxrss keeps the forking parent's size across exec.
    child = ("import sys\nfrom planner.cli import main\ncode = main(sys.argv[1:])\n"
             "print(next(int(line.split()[1]) for line in open('/proc/self/status') "
             "if line.startswith('VmHWM:')))\nsys.exit(code)")
    for case in ("hostile_alias_bomb", "hostile_world_source", "hostile_too_many_tensors"):
        run = subprocess.run([sys.executable, "-c", child, "compile",
                              str(CASES / f"{case}.yaml"), "-o", str(tmp_path / "p")],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert run.returncode == 2
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert all(part in run.stderr for part in EXPECTED[case])
        assert int(run.stdout.strip()) * 1024 < MAX_RSS, (case, run.stdout)


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
    from schemas.config_load import config_from_dict

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

    from schemas.config import SECTIONS

    doc = (ROOT / "docs" / "config.md").read_text()
    missing = [f"{sec}.{f.name}" for sec, cls in SECTIONS.items() for f in fields(cls)
               if f"`{sec}.{f.name}`" not in doc]
    assert missing == []


def test_docs_list_every_allowed_value() -> None:
    """Each key's row in docs/config.md lists every value its `Literal` type allows (issue
    34: `target.dtype: fp8_block128` was missing)."""
    import typing
    from dataclasses import fields

    from schemas.config import SECTIONS

    rows = {line.split("|")[1].strip(): line for line in
            (ROOT / "docs" / "config.md").read_text().splitlines()
            if line.startswith("| `")}
    missing = []
    for sec, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            kind = hints[f.name]
            if typing.get_origin(kind) is not typing.Literal:
                continue
            row = rows.get(f"`{sec}.{f.name}`", "")
            missing += [f"{sec}.{f.name}: {v}" for v in typing.get_args(kind)
                        if isinstance(v, str) and f"`{v}`" not in row]
    assert missing == []
