"""A live `sglang.Engine` (SGLang 0.5.23, CPU, TP 1) refitted in shadow mode through the
rdma-plan plugin (`integrations/sglang_shadow.py`): requests served while the update is in
flight all see the previous version, the switch makes it bit-exact, a torn update leaves
the last version serving (the driver, `sglang_shadow_driver.py`, says how)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from planner.compiler import compile_file
from tests.support import engine_models, oracles

pytestmark = [pytest.mark.oracle, pytest.mark.extended]
pytest.importorskip("nixl")
oracles.require("sglang")

DRIVER = os.path.join(os.path.dirname(__file__), "sglang_shadow_driver.py")


def test_live_sglang_engine_serves_during_a_shadow_refit_then_switches(tmp_path) -> None:
    hf = engine_models.llama(num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = {"model": {"config": "config.json"},
              "source": {"framework": "fsdp2", "dp": 1, "dtype": "float32"},
              "target": {"engine": "sglang", "tp": 1, "dtype": "float32", "shadow": "full"},
              "cluster": {"placement": "colocated", "hosts": 1, "gpus_per_host": 2,
                          "nics_per_host": 1, "source_gpus_per_host": 1}}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(config))
    compile_file(str(tmp_path / "plan.yaml"), str(tmp_path / "plan.rplan"))
    out = tmp_path / "figures.json"
    arg = {"hf": hf, "plan": str(tmp_path / "plan.rplan"), "tp": 1,
           "steps": 2, "delay_s": 2.0, "out": str(out)}
    env = {k: v for k, v in os.environ.items() if k != "RDMA_PLAN_SECRET"}
    proc = subprocess.run(["nice", sys.executable, DRIVER, json.dumps(arg)], env=env,
                          capture_output=True, text=True, timeout=1200)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "driver:" in ln
             or "Error" in ln]
    assert proc.returncode == 0, "\n".join(lines[-20:]) + "\n" + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert all(s["served_requests"] >= 2 for s in figures["steps"])
    print("\n".join(ln for ln in lines if "driver:" in ln))
