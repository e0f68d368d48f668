"""The executor over UCCL P2P: the 2 x 2 example in 4 processes. Needs `uccl` and an RDMA
NIC (or EFA); skipped where `import uccl` fails."""

from __future__ import annotations

import os
import secrets
import sys

import pytest

from harness.launch import master_store, root_env, spawn_ranks
from tests.support.plans import save, two_by_two

pytest.importorskip("uccl")
import torch  # noqa: E402

pytestmark = pytest.mark.gpu
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def test_four_processes_over_uccl(tmp_path):
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    store, port = master_store(60)  # noqa: F841 (alive while the ranks run)
    gpus = max(torch.cuda.device_count(), 1)
    device = (lambda r: f"cuda:{r % gpus}") if torch.cuda.is_available() else (lambda r: "cpu")
    done = spawn_ranks(lambda r: [sys.executable, WORKER, path, str(r), f"127.0.0.1:{port}",
                                  "3", "uccl", device(r)], 4,
                       env=root_env(RDMA_PLAN_SECRET=secrets.token_hex(32)), timeout=240)
    for f in done:
        assert f.returncode == 0, f"rank {f.rank} failed:\n{f.output[-3000:]}"
