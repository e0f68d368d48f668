"""Every benchmark in `bench/` runs in its tiny CPU mode (seconds each, on a quiet box): an
API change breaks this test, not the next GPU run. Each runs as the command a person
types, in a fresh process; each must exit 0 and print its result table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.launch import ROOT, root_env

pytestmark = pytest.mark.slow


def _run(*argv: str, timeout: float = 600, **env: str) -> str:
    p = subprocess.run([sys.executable, *argv], cwd=ROOT, env=root_env(**env),
                       capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(argv)} exited {p.returncode}:\n{out[-4000:]}"
    return p.stdout


def test_every_benchmark_has_a_tiny_mode_here() -> None:
    # a new benchmark must come with a tiny mode and a test below (step_trace.py and
    # zero_pause_plan.py are modules of executor_bench.py and zero_pause.py)
    scripts = sorted(n for n in os.listdir(os.path.join(ROOT, "bench"))
                     if n.endswith(".py") or os.path.isdir(os.path.join(ROOT, "bench", n))
                     and not n.startswith("__"))
    assert scripts == ["compile_scale.py", "defaults.py", "executor_bench.py", "gpu_refit",
                       "long_run.py", "plan_files.py", "published.py", "replan.py",
                       "step_trace.py", "traced_compile.py", "zero_pause.py",
                       "zero_pause_plan.py"]


def test_plan_files_tiny(tmp_path) -> None:
    out = _run("bench/plan_files.py", "--tiny", "--log", str(tmp_path / "log"))
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    steps = ("compile", "load1", "inspect", "ranks", "verify", "simulate", "explain")
    assert all(row[k]["rc"] == 0 and row[k]["cpu_s"] > 0 for k in steps), row
    assert row["plan_bytes"] > 0 and row["load1"]["writes"] > 0, row
    assert "| demo.yaml |" in out


def test_compile_scale_tiny() -> None:
    out = _run("bench/compile_scale.py", "--tiny")
    assert "| demo.yaml | 4 |" in out


@pytest.mark.parametrize("mode", [[], ["--fresh"]])
def test_replan_tiny(mode) -> None:
    out = _run("bench/replan.py", "--tiny", *mode)
    rows = [line for line in out.splitlines() if line.startswith("| ") and "%" in line]
    assert len(rows) == 3 and all(r.endswith("| True |") for r in rows)


def test_traced_compile_tiny() -> None:
    pytest.importorskip("vllm")
    out = _run("bench/traced_compile.py", "--tiny")
    # the traced plans equal the hand-written one; the empty cache traces (in a forked
    # tracer, vLLM imported lean or whole: the compiling process imports no torch), the
    # cache hit does not trace
    rows = {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith("| ")}
    assert rows["| traced, empty cache (lean import)"].endswith("| lean | True | False | True |")
    assert rows["| traced, empty cache (whole import)"].endswith("| whole | True | False | True |")
    assert rows["| traced, cached"].endswith("| none | False | False | True |")
    assert rows["| rules"].endswith("| none | False | False | True |")


def test_defaults_tiny() -> None:
    out = _run("bench/defaults.py", "--tiny")
    # with NVLink rows at the copy kernel's 20 ns, `balance` sends 3 of 8 tensors as rows
    assert "| demo.yaml | 3,214 |" in out and "Worst ratio" in out
    assert "| 0.0 / 0.8 |" in out  # staging: sources none, targets 0.8 MB (< 2 MB)


def test_published_tiny() -> None:
    out = _run("bench/published.py", "--tiny")
    assert "| qwen3-4b_dp8_to_vllm-tp8 |" in out


def test_executor_bench_tiny_nixl_and_local(tmp_path) -> None:
    pytest.importorskip("nixl")
    out = _run("bench/executor_bench.py", "--tiny", BENCH_TRACE=str(tmp_path))
    for event in ("| source | got READY |", "| source | landed |", "| target | got DONE |"):
        assert event in out  # step_trace.py: both ranks' events on one axis
    assert "| nixl (2 processes, cpu) | raw nixl write |" in out
    assert "| local (run_all_local, cpu) | torch copy_ |" in out
    assert out.count("| yes |") == 2  # both rows bit-exact


def test_long_run_tiny() -> None:
    pytest.importorskip("nixl")
    out = _run("bench/long_run.py", "--tiny")
    assert "3/3 steps" in out and ": OK" in out


def test_gpu_refit_tiny_on_cpu() -> None:
    pytest.importorskip("nixl")
    out = _run("-m", "bench.gpu_refit", "--tiny")
    assert "rdma-plan (nixl)" in out and "NCCL baseline" in out
    assert "all methods bit-exact: yes" in out


def test_gpu_refit_process_per_model_on_cpu(tmp_path) -> None:
    # each model in its own workers (their own floor), the results merged into one table
    pytest.importorskip("nixl")
    out = _run("-m", "bench.gpu_refit", "--tiny", "--models", "tiny-qwen3,tiny-qwen3-moe",
               "--process-per-model", "--out", str(tmp_path))
    assert out.count("workers finished") == 2 and "all methods bit-exact: yes" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert [m["model"] for m in results["models"]] == ["tiny-qwen3", "tiny-qwen3-moe"]
    for m in results["models"]:
        assert m["floor"]["gbps"] > 0 and m["methods"]["rdma-plan (nixl)"]["bit_exact"]


def test_zero_pause_tiny() -> None:
    # exits 1 unless the live tensors are bit-exact (and unmoved) after every switch and
    # after the paused refit; one row per model
    out = _run("bench/zero_pause.py", "--tiny")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 1")
            or line.startswith("| 2")]
    assert [r[0] for r in rows] == ["| 128x4", "| 256x4"], out
    for r in rows:
        assert float(r[6]) > 0 and float(r[7]) > 0 and float(r[9].rstrip(" |")) > 0, r
    # the chunked shadow's table (bit-exact or exit 1): 2 chunks per model, a pause per chunk
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| chunked ")]
    assert [r[0] for r in rows] == ["| chunked 128x4", "| chunked 256x4"], out
    for r in rows:
        assert r[2] == "2" and float(r[3]) > 0 and float(r[4]) > 0, r
