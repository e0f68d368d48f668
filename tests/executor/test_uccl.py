"""The executor over UCCL P2P: the 2 x 2 example in 4 processes. Needs `uccl` and an RDMA
NIC (or EFA); skipped where `import uccl` fails."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from datetime import timedelta

import pytest
from exec_plans import HERE, ROOT, free_port, save, two_by_two

pytest.importorskip("uccl")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytestmark = pytest.mark.gpu


def test_four_processes_over_uccl(tmp_path):
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # noqa: F841
                          timeout=timedelta(seconds=60))
    gpus = max(torch.cuda.device_count(), 1)
    device = (lambda r: f"cuda:{r % gpus}") if torch.cuda.is_available() else (lambda r: "cpu")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "worker.py"), path, str(r),
                               f"127.0.0.1:{port}", "3", "uccl", device(r)],
                              env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + HERE,
                                   "RDMA_PLAN_SECRET": secrets.token_hex(32)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(4)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out[-3000:]}"
