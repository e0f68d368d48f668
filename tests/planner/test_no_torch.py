"""The compiler and the CLI import no torch: `rdma-plan compile` runs on
a machine without it, and does not pay torch's import time (12-37 s on a loaded box).

A fresh process installs a meta-path finder that makes `import torch` fail, then imports
the compiler and runs every plan command on plans/demo.yaml. The check can fail: the same
process with `harness.weights` (the torch-based test references) imported must refuse.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, NoTorch())
"""


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "no_torch.py"
    script.write_text(BLOCKER + body)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_compiler_and_cli_run_without_torch(tmp_path: Path) -> None:
    plan = tmp_path / "demo.rplan"
    run = _run(f"""
import planner.compiler
from planner.cli import main

plan = {str(plan)!r}
assert main(["compile", "plans/demo.yaml", "-o", plan]) == 0
for argv in (["inspect", plan], ["verify", plan], ["simulate", plan],
             ["explain", plan, "model.embed_tokens.weight"],
             ["spec", "plans/models/tiny-qwen3"]):
    assert main(argv) == 0, argv
assert "torch" not in sys.modules
print("ok without torch")
""", tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("ok without torch")
    assert plan.stat().st_size > 0


def test_a_cached_trace_compiles_without_torch(tmp_path: Path) -> None:
    # the cache file is written from the hand-written layout (what a trace of this family
    # equals: tests/oracles/test_vllm_trace.py); a hit must not import torch or vLLM
    config = tmp_path / "traced.yaml"
    text = (ROOT / "plans" / "demo.yaml").read_text()
    config.write_text(text.replace("models/tiny-qwen3", str(ROOT / "plans/models/tiny-qwen3"))
                      .replace("  replicas: 2", "  replicas: 2\n  layout: traced"))
    run = _run(f"""
import dataclasses, os
os.environ["RDMA_PLAN_CACHE"] = {str(tmp_path / "cache")!r}
from planner.cli import main
from planner.layouts import traced, vllm
from planner.validate import load

cfg, spec = load({str(config)!r})
assert cfg.target.layout == "traced"
engine = [r.tensors for r in vllm.layout(spec, dataclasses.replace(cfg.target, replicas=1)).ranks]
key = traced.cache_key(traced.model_hf(cfg), cfg.target)
traced.write_cache(os.path.join(traced.cache_dir(), "traced", key + ".msgpack"), key, engine)
assert main(["compile", {str(config)!r}, "-o", {str(tmp_path / "t.rplan")!r}]) == 0
assert "torch" not in sys.modules and "vllm" not in sys.modules
print("ok without torch")
""", tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("ok without torch")


def test_the_blocker_does_block(tmp_path: Path) -> None:
    run = _run("import harness.weights\n", tmp_path)
    assert run.returncode != 0 and "torch is blocked in this test" in run.stderr
