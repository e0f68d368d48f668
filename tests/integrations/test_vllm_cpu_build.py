"""`tests.support.vllm_cpu_build` builds a real vLLM 0.33 model on CPU (the PyPI wheel, no
`vllm._C`): a Qwen3-MoE (the CPU MoE experts' prepack is one of the patched steps), loaded
through vLLM's own `load_weights`, equal bit for bit to our vLLM layout; without the
helper's patches the same build fails (the control: the patches are needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.oracles.launch import free_port
from tests.support import engine_models, oracles

pytestmark = [pytest.mark.oracle, pytest.mark.extended]  # one vLLM process, ~1-3 minutes
oracles.require("vllm")

WORKER = os.path.join(os.path.dirname(__file__), "vllm_cpu_build_worker.py")


def test_helper_builds_a_real_vllm_model_on_cpu(tmp_path) -> None:
    hf = engine_models.qwen3_moe(num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    arg = {"port": free_port(), "hf": hf, "folder": str(tmp_path)}
    proc = subprocess.run(["nice", sys.executable, WORKER, json.dumps(arg)],
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    print(out["control"])
    assert "accelerator" in out["control"], out  # without the patches: no CPU build
    assert out["type"] == "Qwen3MoeForCausalLM", out
    assert out["compared"] > 10 and out["names_equal"] and out["wrong"] == [], out
