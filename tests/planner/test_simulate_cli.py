"""`rdma-plan simulate` and `inspect --plot` on a compiled synthetic plan; the PNGs are
written and non-trivial; a missing matplotlib is one clear error (exit 2)."""

from __future__ import annotations

import json
import sys

import pytest

from planner.cli import main
from planner.compiler import compile_layouts
from planner.spec import spec_from_hf
from schemas.config import ClusterConfig, Config, ModelConfig, Options, SourceConfig, TargetConfig
from schemas.plan_write import write_plan
from tests.support.synthetic import fused_col_split, row_split

HF = dict(model_type="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, intermediate_size=96, vocab_size=101, num_hidden_layers=2,
          tie_word_embeddings=False)


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> str:
    spec = spec_from_hf(HF)
    cfg = Config(model=ModelConfig("unused"), source=SourceConfig("fsdp2", dp=3),
                 target=TargetConfig("vllm", tp=2, replicas=2),
                 cluster=ClusterConfig(gpus_per_host=4, nics_per_host=2), options=Options())
    path = str(tmp_path_factory.mktemp("plans") / "p.rplan")
    write_plan(path, compile_layouts(cfg, spec, row_split(spec, 3), fused_col_split(spec, 2, 2)))
    return path


def test_simulate_prints_estimate_floor_and_ratio(plan_path, capsys):
    assert main(["simulate", plan_path]) == 0
    out = capsys.readouterr().out
    assert "estimated" in out and "floor" in out and "ratio" in out


def test_simulate_json(plan_path, capsys):
    assert main(["simulate", plan_path, "--json", "--inflight", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["estimated_s"] >= res["floor_s"] > 0
    assert res["inflight"] == 1 and "timeline" not in res


def test_plots_are_written(plan_path, tmp_path):
    pytest.importorskip("matplotlib")
    sim, ins = tmp_path / "sim.png", tmp_path / "inspect.png"
    assert main(["simulate", plan_path, "--plot", str(sim)]) == 0
    assert main(["inspect", plan_path, "--plot", str(ins)]) == 0
    for png in (sim, ins):
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_missing_matplotlib_is_one_clear_error(plan_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["simulate", plan_path, "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rdma-plan: error: --plot needs matplotlib") and "pip install" in err


def _damaged(plan_path: str, blob: str, out: str) -> str:
    """A copy of the plan with one stored byte of `blob` flipped (its digest then fails)."""
    from schemas.plan import open_plan, read_header

    with open_plan(plan_path) as f:
        header, start = read_header(f, plan_path)
    data = bytearray(open(plan_path, "rb").read())
    entry = header.blobs[blob]
    data[start + entry.offset + entry.length // 2] ^= 0xFF
    with open(out, "wb") as f:
        f.write(data)
    return out


@pytest.mark.parametrize("blob", ["explain", "dag", "tensors/0"])
def test_simulate_reads_and_checks_only_the_header_and_the_ranks(plan_path, tmp_path, blob,
                                                                capsys):
    """A blob `simulate` never reads is not its to check: damaged, the plan simulates to
    the same answer (`verify` refuses it, naming the blob); a damaged rank blob, which it
    reads, is refused naming that blob."""
    assert main(["simulate", plan_path, "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    bad = _damaged(plan_path, blob, str(tmp_path / "bad.rplan"))
    assert main(["simulate", bad, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    for res in (want, got):
        res.pop("sim_seconds", None)
    assert got == want
    assert main(["verify", bad]) != 0
    assert blob in capsys.readouterr().err
    rank = _damaged(plan_path, "rank/1", str(tmp_path / "rank.rplan"))
    assert main(["simulate", rank, "--json"]) == 2
    err = capsys.readouterr().err
    assert "rank/1" in err and "checksum mismatch" in err
