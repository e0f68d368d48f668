"""`rdma-plan` as a new user meets it: each friction item a new user reported and the
"never a traceback for any input file" rule, each with a test that fails on the old CLI.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main
from schemas.plan import load_plan
from schemas.plan_write import encode_plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "plans" / "models" / "tiny-qwen3" / "config.json"


def _config(tmp: Path, name: str, source: str, target: str, cluster: str = "") -> Path:
    path = tmp / name
    path.write_text(f"model:\n  config: {TINY}\nsource:\n{source}target:\n{target}{cluster}")
    return path


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> str:
    """plans/demo.yaml compiled: Megatron tp 2 -> 2 vLLM engines, colocated (NVLink only)."""
    path = str(tmp_path_factory.mktemp("demo") / "demo.rplan")
    assert main(["compile", str(ROOT / "plans/demo.yaml"), "-o", path]) == 0
    return path


@pytest.fixture(scope="module")
def fsdp16(tmp_path_factory: pytest.TempPathFactory) -> str:
    """FSDP2 over 16 ranks (every tensor row-sharded 16 ways) into 2 vLLM engines of tp 2, on
    hosts of 8 GPUs: the compiler gathers the fine-cut boxes before fanning them out."""
    tmp = tmp_path_factory.mktemp("fsdp16")
    cfg = _config(tmp, "c.yaml", "  framework: fsdp2\n  dp: 16\n",
                  "  engine: vllm\n  tp: 2\n  replicas: 2\n")
    path = str(tmp / "p.rplan")
    assert main(["compile", str(cfg), "-o", path]) == 0
    return path


def _err_lines(capsys: pytest.CaptureFixture) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


# ---------------------------------------------------------------- simulate --inflight

@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_simulate_inflight_must_be_positive(demo: str, value: str,
                                            capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate", demo, "--inflight", value]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("rdma-plan: error: argument --inflight:") and value in line


# ---------------------------------------------------------------- broken pipe

def test_inspect_into_a_closed_pipe_is_not_an_error(demo: str) -> None:
    # `rdma-plan inspect PLAN | head -0`: the reader is gone before the first line.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "planner", "inspect", demo, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    proc.stdout.close()  # type: ignore[union-attr]
    err = proc.stderr.read().decode()  # type: ignore[union-attr]
    assert proc.wait(timeout=120) == 0, err
    assert err == ""


# ---------------------------------------------------------------- -o

def test_output_into_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "nope" / "p.rplan"
    assert main(["compile", str(ROOT / "plans/demo.yaml"), "-o", str(out)]) == 2
    (line,) = _err_lines(capsys)
    assert line == (f"rdma-plan: error: -o: {str(out)!r}: the folder {str(out.parent)!r} does "
                    "not exist; create it or write the plan elsewhere")
    assert os.listdir(tmp_path) == []


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The plan is written as PATH.tmpPID, then renamed; a failing rename (a full disk, a
    # read-only target) must not leave the temporary file behind.
    def no_rename(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device", dst)

    monkeypatch.setattr(os, "replace", no_rename)
    out = tmp_path / "p.rplan"
    assert main(["compile", str(ROOT / "plans/demo.yaml"), "-o", str(out)]) == 2
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- --debug

@pytest.mark.parametrize("argv", [["--debug", "inspect"], ["inspect", "--debug"]])
def test_debug_before_or_after_the_subcommand(argv: list[str], tmp_path: Path) -> None:
    bad = tmp_path / "garbage.rplan"
    bad.write_bytes(b"not a plan at all")
    with pytest.raises(Exception, match="garbage.rplan"):  # the traceback, not exit 2
        main([*argv, str(bad)])


def test_without_debug_the_same_error_is_one_line(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "garbage.rplan"
    bad.write_bytes(b"not a plan at all")
    assert main(["inspect", str(bad)]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("rdma-plan: error: ") and "garbage.rplan" in line


# ---------------------------------------------------------------- explain

def test_explain_text_and_json(demo: str, capsys: pytest.CaptureFixture) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    assert main(["explain", demo, name]) == 0
    text = capsys.readouterr().out
    # q_proj [256, 256] bf16 = 131,072 bytes, into 2 engines of tp 1; Megatron tp 2 holds
    # it in 2 halves (rows of linear_qkv), one per source rank.
    assert text.startswith(f"{name}: 262,144 bytes into 2 target ranks from 2 source ranks")
    assert main(["explain", demo, name, "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert (e["bytes"], e["target_ranks"], e["source_ranks_holding"]) == (262_144, 2, [0, 1])
    assert e["gathered_on"] == [] and sum(w["bytes"] for w in e["writes"]) == 262_144


def test_explain_takes_checkpoint_names_and_suggests(demo: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    # A Megatron native name: say what explain takes; a typo: suggest the close names.
    assert main(["explain", demo, "decoder.layers.0.self_attention.linear_qkv.weight"]) == 2
    (line,) = _err_lines(capsys)
    assert "explain takes HF checkpoint names" in line
    assert main(["explain", demo, "model.layers.0.self_attn.q_prj.weight"]) == 2
    (line,) = _err_lines(capsys)
    assert "did you mean model.layers.0.self_attn.q_proj.weight" in line
    # a part of the name left out: the names holding every part given, in order
    assert main(["explain", demo, "model.layers.0.q_proj.weight"]) == 2
    (line,) = _err_lines(capsys)
    assert line.endswith("did you mean model.layers.0.self_attn.q_proj.weight?")


def test_explain_shows_gathers(fsdp16: str, capsys: pytest.CaptureFixture) -> None:
    # down_proj [256, 512] is row-sharded over the 16 FSDP2 ranks (16 rows each) on two
    # hosts; each target box is gathered into one owner's staging, then written.
    assert main(["explain", fsdp16, "model.layers.0.mlp.down_proj.weight", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["source_ranks_holding"] == list(range(16))
    assert e["gathered_on"] and e["source_ranks_sending"] == e["gathered_on"]
    assert main(["explain", fsdp16, "model.layers.0.mlp.down_proj.weight"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("into 4 target ranks from 16 source ranks")
    assert lines[1].startswith("  gathered first: the 16 source ranks holding pieces of it")


# ---------------------------------------------------------------- inspect wording

def test_inspect_calls_the_floor_a_floor(fsdp16: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", fsdp16]) == 0
    out = capsys.readouterr().out
    assert "estimated time" not in out
    assert "a lower bound, not an estimate" in out and "`rdma-plan simulate` estimates" in out


def test_the_egress_bound_is_never_below_one(fsdp16: str, capsys: pytest.CaptureFixture) -> None:
    # The compiler's bound counts only bytes that some NIC set alone holds; with gathers
    # it is far below the plan's mean egress (0 here). max/mean is never below 1.
    assert load_plan(fsdp16).header.stats.egress_bound_max_over_mean < 1
    assert main(["inspect", fsdp16, "--json"]) == 0
    bound = json.loads(capsys.readouterr().out)["balance"]["egress_bound_max_over_mean"]
    assert bound == 1.0
    assert main(["inspect", fsdp16]) == 0
    assert "gets egress below 1.000" in capsys.readouterr().out


# ---------------------------------------------------------------- plan files: no tracebacks

@pytest.mark.parametrize("world", [5, 2**31])
def test_inspect_refuses_what_load_plan_refuses(demo: str, tmp_path: Path, world: int,
                                                capsys: pytest.CaptureFixture) -> None:
    # A header that claims ranks the file holds no plan for: the header itself reads fine,
    # `inspect` must refuse it in one line as `load_plan` does, and with 2**31 ranks
    # before building a name per claimed rank.
    plan = load_plan(demo)
    bad = tmp_path / "world.rplan"
    bad.write_bytes(encode_plan(dataclasses.replace(plan, header=dataclasses.replace(plan.header,
                                                                   world=world))))
    assert main(["inspect", str(bad)]) == 2
    (line,) = _err_lines(capsys)
    assert str(world) in line and "corrupt" in line


def _mutants(data: bytes, n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out = [b"", data[:7], data[: len(data) // 2], data[:-1], b"\x00" * len(data)]
    while len(out) < n:
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(b))
            b[i] = rng.randrange(256)
        out.append(bytes(b))
    return out


def test_no_command_prints_a_traceback_for_any_plan_file(demo: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    # Truncated, zeroed and byte-flipped copies of a plan, through every command that reads
    # plans: each exits 0 (a flip that changes nothing checked), 1 (verify found a
    # violation) or 2 with one line, and never raises.
    data = Path(demo).read_bytes()
    path = tmp_path / "m.rplan"
    name = "model.layers.0.self_attn.q_proj.weight"
    codes: dict[int, int] = {}
    for i, mutant in enumerate(_mutants(data, 60, seed=16)):
        path.write_bytes(mutant)
        for argv in (["inspect"], ["verify"], ["simulate"], ["explain"]):
            extra = [name] if argv == ["explain"] else []
            code = main([*argv, str(path), *extra])
            captured = capsys.readouterr()
            assert code in (0, 1, 2), (i, argv)
            if code == 2:
                assert len(captured.err.strip().splitlines()) == 1, (i, argv, captured.err)
            codes[code] = codes.get(code, 0) + 1
    assert codes.get(2, 0) >= 5 * 4  # at least the five broken files, by every command


# ---------------------------------------------------------------- plots

def _figures(monkeypatch: pytest.MonkeyPatch) -> list:
    plt = pytest.importorskip("matplotlib.pyplot")
    figs: list = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figs.append(fig), close(fig)))
    return figs


def test_colocated_plots_say_there_is_no_nic_traffic(demo: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    figs = _figures(monkeypatch)
    assert main(["inspect", demo, "--plot", str(tmp_path / "i.png")]) == 0
    assert main(["simulate", demo, "--plot", str(tmp_path / "s.png")]) == 0
    inspect_nics, sim_nics = figs[0].axes[1], figs[2].axes[0]  # figs[1]: the traffic matrix
    for ax in (inspect_nics, sim_nics):
        assert not ax.axison and not ax.patches  # no empty bars
        assert any("no NIC traffic" in t.get_text() for t in ax.texts)
    ticks = figs[2].axes[1].get_yticks()  # the timeline's source ranks
    assert len(ticks) and all(float(t).is_integer() for t in ticks)


@pytest.mark.parametrize("which", ["demo", "fsdp16"])
def test_the_traffic_matrix_adds_up_to_the_plans_bytes(which: str, request: pytest.FixtureRequest,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # inspect --plot FILE.png also draws FILE-traffic.png: who writes how many bytes to
    # whom, NVLink (same host) and NICs (across hosts) apart; each panel's cells add up to
    # the header's own totals, and only source ranks write to targets or to staging.
    plan = request.getfixturevalue(which)
    figs = _figures(monkeypatch)
    assert main(["inspect", plan, "--plot", str(tmp_path / "i.png")]) == 0
    assert (tmp_path / "i-traffic.png").stat().st_size > 0
    header = load_plan(plan).header
    nvlink, nic = (ax.images[0].get_array().filled(0) for ax in figs[1].axes[:2])
    assert nvlink.sum() == header.stats.nvlink_bytes
    assert nic.sum() == header.stats.remote_bytes
    assert nvlink.shape == nic.shape == (header.world, header.world)
    assert not (nvlink + nic)[header.sources:].any()  # targets write nothing


# ---------------------------------------------------------------- inspect tables

def test_long_tables_name_the_rows_left_out_where_they_are() -> None:
    from planner.tools.inspect import SHOWN, _table

    rows = [[str(r), f"{r * 10**9:,}"] for r in range(600)]
    lines = _table(["rank", "staging"], rows, "ranks")
    assert lines[SHOWN + 1] == "... ranks 16 to 583 left out (568 rows; --json lists all)"
    assert lines[SHOWN].split()[0] == "15" and lines[SHOWN + 2].split()[0] == "584"
    # the widest number (13 characters and more) keeps two spaces from its neighbour
    assert lines[-1] == "599   599,000,000,000" and lines[0] == "rank          staging"


def test_inspect_of_a_plan_without_nic_traffic_says_so(demo: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", demo]) == 0
    out = capsys.readouterr().out
    assert "nics: none carries a byte: every write stays on its host (NVLink" in out
    assert "bytes out       bytes in" not in out.split("rank  role")[0]
    assert "ep=" not in out and "2 replicas" in out and "(2.74M params)" in out


# ---------------------------------------------------------------- bugs print as bugs

def test_a_compiler_bug_is_not_reported_as_bad_input(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI catches UserError (bad input), not every ValueError: a ValueError raised
    # inside the compiler is a bug and must surface with its traceback.
    import planner.compiler

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(planner.compiler, "compile_config", broken)
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(["compile", str(ROOT / "plans/demo.yaml"), "-o", str(tmp_path / "p.rplan")])
    assert os.listdir(tmp_path) == []
