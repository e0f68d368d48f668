"""Every shipped config (plans/*.yaml, plans/published/*.yaml) compiles and verifies, with
`rdma-plan verify` run in a subprocess under an address-space cap (`resource.setrlimit`): a
verify that grows with the plan (one was once killed for its memory on a large model) fails
here, not in a user's session. The large plans (seconds to minutes to compile) are in the
deep profile. Also: the DAG check agrees with networkx on random graphs.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from planner.tools.verify_rank import acyclic
from tests.support.shipped import CONFIGS, shipped_param

ROOT = Path(__file__).resolve().parents[2]
CAP = 2 << 30
"""Address space a verify may map (2 GiB)."""
QUICK = {"demo.yaml", "demo-moe.yaml", "qwen3-8b_megatron-tp2_vllm-tp2.yaml",
         "qwen3-8b_megatron-tp4pp2_vllm-tp2x4.yaml", "qwen3-30b-a3b_megatron-ep8_vllm-tp2-ep.yaml",
         "llama-3.1-8b_megatron-tp4pp2dp2_vllm-tp2x4.yaml", "qwen3-4b_dp8_to_vllm-dp8.yaml",
         "qwen3-4b_dp8_to_vllm-tp8.yaml", "qwen3-4b_pp2dp4_to_vllm-tp4dp2.yaml",
         "gpt-oss-120b_fsdp2-16_vllm-tp4-ep-x8.yaml"}
"""Configs that compile in a few seconds (the rest are in the deep profile)."""

_CAPPED = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap})); "
           "from planner.cli import main; sys.exit(main(['verify', {path!r}]))")


@pytest.mark.parametrize("config", [shipped_param(p, QUICK) for p in CONFIGS])
def test_shipped_config_verifies_under_a_memory_cap(config: Path, tmp_path: Path) -> None:
    plan = tmp_path / "p.rplan"
    subprocess.run([sys.executable, "-m", "planner", "compile", str(config), "-o", str(plan)],
                   cwd=ROOT, check=True, capture_output=True, timeout=1800)
    try:
        run = subprocess.run([sys.executable, "-c", _CAPPED.format(cap=CAP, path=str(plan))],
                             cwd=ROOT, capture_output=True, text=True, timeout=1800)
    finally:
        plan.unlink()
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith(": ok")


def test_a_verify_over_the_cap_fails_the_test() -> None:
    """The cap is real: the same subprocess asked to hold 3 GiB fails."""
    code = _CAPPED.split("from planner")[0] + "b = bytearray(3 << 30)"
    run = subprocess.run([sys.executable, "-c", code.format(cap=CAP)], capture_output=True)
    assert run.returncode != 0 and b"MemoryError" in run.stderr


def test_acyclic_agrees_with_networkx() -> None:
    rng = random.Random(38)
    for t in range(400):
        n, m = rng.randint(1, 30), rng.randint(0, 60)
        u = np.array([rng.randrange(n) for _ in range(m)], dtype=np.int64)
        v = np.array([rng.randrange(n) for _ in range(m)], dtype=np.int64)
        if t % 2:  # half of them DAGs by construction
            keep = u < v
            u, v = u[keep], v[keep]
        g = nx.DiGraph()
        g.add_nodes_from(range(n))
        g.add_edges_from(zip(u.tolist(), v.tolist()))
        assert acyclic(n, u, v) == nx.is_directed_acyclic_graph(g), (n, u, v)
    assert not acyclic(2, np.array([0]), np.array([5]))  # an edge naming no node
