"""`rdma-plan inspect` says why a rank has staging: the stage that puts the most bytes
there, whether packs (this rank's tensors) or unpacks (into this rank's tensors) fill it,
and the tensor with most of those bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.compiler import compile_file

ROOT = Path(__file__).resolve().parents[2]


def inspected(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> dict:
    plan = str(tmp_path / "p.rplan")
    compile_file(str(ROOT / "plans" / name), plan)
    assert main(["inspect", plan, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main(["inspect", plan]) == 0
    text = capsys.readouterr().out
    for r in out["ranks"]:
        assert bool(r["staging"]) == bool(r["staging_why"])
        if r["staging_why"]:
            assert r["staging_why"] in text
    return out


def test_a_source_that_packs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ranks = inspected("demo-moe.yaml", tmp_path, capsys)["ranks"]
    why = {r["rank"]: r["staging_why"] for r in ranks}
    assert why[1].startswith("stage 1: packed from decoder.layers.")
    assert why[1].endswith("; source, up to the cap (1024 MiB)")  # how its budget was chosen
    assert why[0] == why[2] == ""


def test_targets_that_unpack(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = inspected("llama-3.1-8b_megatron-tp4pp2dp2_vllm-tp2x4.yaml", tmp_path, capsys)
    targets = [r for r in out["ranks"] if r["role"] == "target"]
    assert targets and all("unpacked into model.layers." in r["staging_why"]
                           for r in targets)
    # a target's budget: the write window (4 of its largest staged writes per slot)
    assert all("; target, slots of 4 x its largest write" in r["staging_why"] for r in targets)
    assert all(r["staging_why"] == "" for r in out["ranks"] if r["role"] == "source")
