"""The executor over CUDA IPC: 4 processes on one GPU (IPC handles work across processes
of one device too), the 2 x 2 example, several steps, bit-exact. Run on the device:
`pytest -m gpu tests/executor/test_cuda_ipc.py`."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from exec_plans import HERE, ROOT, free_port, save, two_by_two

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_four_processes_over_cuda_ipc(tmp_path):
    import torch.distributed as dist

    path = save(str(tmp_path / "p.rplan"), two_by_two())
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # noqa: F841
                          timeout=timedelta(seconds=60))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + HERE,
           "RDMA_PLAN_SECRET": secrets.token_hex(32)}
    gpus = torch.cuda.device_count()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "worker.py"), path, str(r),
                               f"127.0.0.1:{port}", "3", "cuda_ipc", f"cuda:{r % gpus}"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(4)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out[-3000:]}"
        assert f"rank {r} step 3: ok" in out
