"""SGLang's real EPLB metadata object read by the SGLang backend's placement check
(`sglang_placement_worker.py`, in its own process: SGLang's private install)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.launch import ROOT, root_env
from tests.support import oracles

pytestmark = pytest.mark.oracle
oracles.require("sglang")


def test_sglang_metadata_is_read_and_a_stale_plan_refused() -> None:
    script = os.path.join(os.path.dirname(__file__), "sglang_placement_worker.py")
    p = subprocess.run([sys.executable, script], cwd=ROOT, env=root_env(), text=True,
                       capture_output=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("refused:") == 2
