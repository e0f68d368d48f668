"""`simulate`'s coarse model (landings within a quantum land together, one rate computation
for the group; `planner.tools.simflow.choose_quantum`): its estimate within the tolerance it
states (`COARSE_STATED`) of the exact model's on plans compiled from shipped configs, with
fewer events; the same tolerance fails when the quantum is ten times larger (the check is
sensitive); deterministic; progress lines; the "auto" model exact on small plans and coarse
above `EXACT_MAX_BATCHES`; the CLI's `--exact` and the line that names the coarse model;
the gap report's "coarse model" share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import planner.tools.simflow as simflow
from planner.cli import main
from planner.tools.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["plans/qwen3-8b_megatron-tp4pp2_vllm-tp2x4.yaml",
           "plans/published/qwen3-4b_pp2dp4_to_vllm-tp4dp2.yaml",
           "plans/llama-3.1-8b_megatron-tp4pp2dp2_vllm-tp2x4_fp8.yaml"]
"""Shipped configs that compile in seconds into plans of hundreds to a thousand batches."""


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> list[str]:
    out = []
    for cfg in CONFIGS:
        path = str(tmp_path_factory.mktemp("coarse") / (Path(cfg).stem + ".rplan"))
        assert main(["compile", str(ROOT / cfg), "-o", path]) == 0
        out.append(path)
    return out


def _deviation(path: str) -> tuple[float, dict, dict]:
    exact, coarse = simulate(path, model="exact"), simulate(path, model="coarse")
    assert exact["model"] == "exact" and coarse["model"] == "coarse"
    return abs(coarse["estimated_s"] / exact["estimated_s"] - 1), exact, coarse


def test_coarse_is_within_its_stated_tolerance_of_exact(plans):
    for path in plans:
        dev, exact, coarse = _deviation(path)
        assert dev <= simflow.COARSE_STATED, (path, dev)
        assert coarse["events"] < exact["events"], path  # landings were grouped
        assert coarse["floor_s"] == exact["floor_s"]


def test_a_ten_times_larger_quantum_breaks_the_tolerance(plans, monkeypatch):
    monkeypatch.setattr(simflow, "COARSE_TOL", 10 * simflow.COARSE_TOL)
    assert max(_deviation(p)[0] for p in plans) > simflow.COARSE_STATED


def test_coarse_is_deterministic(plans):
    a, b = simulate(plans[1], model="coarse"), simulate(plans[1], model="coarse")
    for k in ("estimated_s", "rank_finish_s", "events", "nics", "gap", "quantum_s"):
        assert a[k] == b[k], k
    for k, col in a["timeline"].items():
        assert np.array_equal(col, b["timeline"][k]), k


def test_coarse_reports_batches_landed(plans):
    lines: list[str] = []
    res = simulate(plans[0], progress=lines.append, model="coarse")
    counts = [int(x.split()[1].split("/")[0].replace(",", "")) for x in lines
              if "batches landed" in x]
    assert 5 <= len(counts) <= 10 and counts == sorted(counts)
    assert counts[-1] <= res["batches"] and lines.index("simulating") < len(lines) - len(counts)


def test_auto_is_exact_below_the_threshold_and_coarse_above(plans, monkeypatch):
    small = simulate(plans[0])
    assert small["model"] == "exact" and small["quantum_s"] == 0.0
    assert small["estimated_s"] == simulate(plans[0], model="exact")["estimated_s"]
    monkeypatch.setattr(simflow, "EXACT_MAX_BATCHES", small["batches"] - 1)
    big = simulate(plans[0])
    assert big["model"] == "coarse" and big["quantum_s"] > 0
    assert big["estimated_s"] == simulate(plans[0], model="coarse")["estimated_s"]
    with pytest.raises(ValueError, match="model 'fast'"):
        simulate(plans[0], model="fast")


def test_cli_names_the_coarse_model_and_exact_forces_the_exact_one(plans, monkeypatch, capsys):
    monkeypatch.setattr(simflow, "EXACT_MAX_BATCHES", 10)
    assert main(["simulate", plans[1]]) == 0
    out = capsys.readouterr().out
    assert "coarse model" in out and "--exact" in out and "within 0.5%" in out
    assert main(["simulate", plans[1], "--exact"]) == 0
    assert "coarse model" not in capsys.readouterr().out


def test_the_gap_report_separates_the_coarse_models_slack(plans):
    for path in plans:
        exact, coarse = simulate(path, model="exact"), simulate(path, model="coarse")
        assert "coarse model" not in exact["gap"].get("causes", {})
        c = coarse["gap"]["causes"]
        assert c["coarse model"] != 0.0  # groups landed off their flows' own ends
        # the coarse model's busy time below the full rate is split, not grown
        below = c["per-write costs"] + c["shared below its rate"] + c["coarse model"]
        busy = coarse["gap"]["busy_fraction"] * coarse["estimated_s"]
        assert below == pytest.approx(max(busy - coarse["floor_s"], 0.0), abs=1e-12)
