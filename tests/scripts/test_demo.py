"""The README's main job, end to end: `scripts/demo.py` compiles a config and runs it as
one process per rank over NIXL (UCX), checking every target tensor bit-exactly after each
step (weights change every step). Dense demo over the default UCX transports and over
TCP (`UCX_TLS=tcp`); a MoE config with expert parallelism on both sides; fp32 sources
through a small staging budget (dozens of stages, packed early, writes in flight across
stage boundaries). UCX over TCP reads small messages at post time, so a race between
early packs and writes in flight does not show here: tests/executor/test_late_reads.py
holds that check, with writes that read their source late."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("nixl")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("config,tls,steps", [
    ("plans/demo.yaml", None, 3),
    ("plans/demo.yaml", "tcp", 2),
    ("plans/demo-moe.yaml", None, 2),
    # dozens of stages: early packs and writes in flight across stages, over TCP
    ("tests/configs/staged-fp32.yaml", "tcp", 3),
])
def test_demo_runs_bit_exact_over_nixl(config, tls, steps):
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    if tls:
        env["UCX_TLS"] = tls
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo.py"),
                          "--config", os.path.join(ROOT, config), "--steps", str(steps)],
                         capture_output=True, text=True, timeout=400, env=env)
    tail = res.stdout[-2000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert "target tensors bit-exact after every step: yes" in res.stdout, tail
    rows = [line for line in res.stdout.splitlines() if re.match(r"\s+\d+ target ", line)]
    assert len(rows) == 2, tail  # both target ranks reported every step
