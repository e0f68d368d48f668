"""The executor over NIXL between 4 processes (2 sources, 2 targets), several steps."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from datetime import timedelta

import pytest
from exec_plans import HERE, ROOT, free_port, save, two_by_two

pytest.importorskip("nixl")
import torch.distributed as dist  # noqa: E402


@pytest.mark.parametrize("tls", [None, "tcp"])
def test_four_processes_bit_exact_each_step(tmp_path, tls):
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # noqa: F841
                          timeout=timedelta(seconds=30))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + HERE, "NIXL_LOG_LEVEL": "WARN",
           "RDMA_PLAN_SECRET": secrets.token_hex(32)}
    if tls:
        env["UCX_TLS"] = tls
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "worker.py"), path,
                               str(r), f"127.0.0.1:{port}", "3"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(4)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out[-3000:]}"
        assert f"rank {r} step 3: ok" in out


def test_source_that_never_runs_times_out_on_its_targets(tmp_path):
    # rank 0 loads (so connect succeeds) but never runs; both targets wait for its DONE
    # and must raise PeerTimeoutError naming rank 0 within their 3 s timeout. Rank 1's
    # part does not depend on rank 0, so it completes.
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # noqa: F841
                          timeout=timedelta(seconds=30))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + HERE, "NIXL_LOG_LEVEL": "WARN",
           "RDMA_PLAN_SECRET": secrets.token_hex(32)}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "worker.py"), path, str(r),
                               f"127.0.0.1:{port}", "0" if r == 0 else "1", "nixl", "cpu", "3"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(4)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert procs[0].returncode == 0 and procs[1].returncode == 0, outs[:2]
    for r in (2, 3):
        assert procs[r].returncode == 3, outs[r][-2000:]
        assert f"rank {r}: PeerTimeoutError peer=0 complete=False" in outs[r]
        assert "within 3 s" in outs[r]
