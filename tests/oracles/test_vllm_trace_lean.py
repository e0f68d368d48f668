"""Oracle: a trace made with vLLM imported lean (`planner/layouts/vllm_lean.py`, what the
forked tracer of `rdma-plan compile` does) equals, row for row, the same trace made with vLLM
imported whole, for every family vLLM serves here: the five hand-written ones (whose whole
traces equal their rules, tests/oracles/test_vllm_trace.py) and the newer hand-written ones
(glm4_moe, mixtral), with TP, PP, DP and EP (gpt_oss's loader does not trace, imported either
way). (A family whose spec comes from
transformers has torch and transformers' model classes imported before the tracer forks:
`vllm_lean.install` declines there, tests/planner/layouts/test_vllm_lean.py.)

The lean traces run in one fresh interpreter (`tests/support/lean_trace.py`); the whole
ones in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from planner.layouts import vllm_lean
from planner.spec import read_hf_config
from tests.support import oracles
from tests.support.engine_models import deepseek_v3, llama, qwen2, qwen3, qwen3_moe
from tests.support.lean_trace import trace_rows

pytestmark = pytest.mark.oracle
oracles.require("vllm")

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "plans" / "models"


def tiny(name: str) -> dict[str, Any]:
    return read_hf_config(str(MODELS / name / "config.json"))


CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("llama tp4 tied", llama(tie_word_embeddings=True), dict(tp=4)),
    ("qwen2 tp2 pp2", qwen2(), dict(tp=2, pp=2)),
    ("qwen3 tp2 bf16", qwen3(), dict(tp=2, dtype="bfloat16")),
    ("qwen3_moe tp2 pp2 dp2 ep", qwen3_moe(num_hidden_layers=9), dict(tp=2, pp=2, dp=2,
                                                                      ep=True)),
    ("qwen3_moe ep3 uneven", qwen3_moe(), dict(tp=3, ep=True)),
    ("deepseek_v3 dp2 tp2 ep", deepseek_v3(num_hidden_layers=7), dict(dp=2, tp=2, ep=True)),
    ("kimi_k2 tp2", deepseek_v3(model_type="kimi_k2", first_k_dense_replace=2), dict(tp=2)),
    ("glm4_moe tp2 ep", tiny("tiny-glm4-moe"), dict(tp=2, ep=True)),
    ("mixtral tp2 pp2", tiny("tiny-mixtral"), dict(tp=2, pp=2)),
    ("refused: tp4 of 6 heads", qwen3_moe(), dict(tp=4)),
]


def test_lean_traces_equal_whole_ones(tmp_path: Path) -> None:
    if not vllm_lean.supported():
        pytest.skip("vLLM, torch or transformers is not the version the lean import is for")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "lean.json"
    res = subprocess.run([sys.executable, "-m", "tests.support.lean_trace", str(out)], cwd=ROOT,
                         input=json.dumps(CASES), capture_output=True, text=True, env=env,
                         timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    lean = json.loads(out.read_text())
    assert lean["lean"] is True
    used = set(lean["used"])
    assert {"vllm.env_override", "torch._inductor", "torch._dynamo",
            "torch.fx.experimental.symbolic_shapes", "sympy"} <= used, used
    for name, hf, kw in CASES:
        whole = json.loads(json.dumps(trace_rows(hf, kw)))  # as the lean rows came: JSON
        got = lean["rows"][name]
        if name.startswith("refused"):
            assert "error" in whole and got == whole, (name, got)
            continue
        assert isinstance(whole, list) and len(whole) > 0, (name, whole)
        assert got == whole, f"{name}: the lean trace differs from the whole one"
