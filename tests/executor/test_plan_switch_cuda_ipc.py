"""Switching plans at a step boundary over CUDA IPC without registering the memory again:
two processes (FSDP2 dp 1 -> vLLM TP 1 with expert parallelism, 10 slots for 8 experts) on
one GPU, or two where there are two; step 1 with plan A, the placement changes, steps 2 and
3 with plan B (replanned from A), bit for bit; after load neither rank registers its regions
again nor opens a peer's handles again (`switch_worker.py` counts the transport's
`register` and `import_peer` calls and prints its `stats()` before and after). Run on the
device: `pytest -m gpu tests/executor/test_plan_switch_cuda_ipc.py`."""

from __future__ import annotations

import json
import os
import secrets
import sys

import pytest
import torch

from harness.launch import master_store, root_env, spawn_ranks
from schemas.plan import WRITE_COLUMNS
from tests.support.placement_plans import write_plans

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "switch_worker.py")

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_switch_over_cuda_ipc_is_bit_exact_without_registering_again(tmp_path):
    plan_a, plan_b = write_plans(str(tmp_path), dp=1, tp=1)
    a, b = plan_a.ranks[0].writes, plan_b.ranks[0].writes
    assert any((a[n] != b[n]).any() for n, _ in WRITE_COLUMNS), \
        "placement B changes no write: the test would show nothing"
    store, port = master_store(60)  # noqa: F841 (alive while the ranks run)
    gpus = torch.cuda.device_count()
    done = spawn_ranks(lambda r: [sys.executable, WORKER, str(tmp_path), str(r),
                                  f"127.0.0.1:{port}", "cuda_ipc", f"cuda:{r % gpus}"], 2,
                       env=root_env(RDMA_PLAN_SECRET=secrets.token_hex(32)), timeout=240)
    for f in done:
        assert f.returncode == 0, f"rank {f.rank} failed:\n{f.output[-3000:]}"
        assert f"rank {f.rank}: ok" in f.output
        assert (f"rank {f.rank}: registrations after load 0, exports 0, peer imports 0, "
                f"register_calls 1, switches 1, fingerprint {plan_b.header.fingerprint[:16]}"
                ) in f.output, f.output[-3000:]
        line = f.output.split(f"rank {f.rank} stats before ", 1)[1].splitlines()[0]
        before, after = (json.loads(x) for x in line.split(" after "))
        for k in ("peers_mapped_here", "handles_opened_here", "regions_mapped_here"):
            assert after[k] == before[k], (k, before, after)
        assert after["degraded"] == 0, after
    target = done[1].output  # the engine's placement is B: plan A refused, in one line
    refused = next(x for x in target.splitlines() if x.startswith("rank 1 refused"))
    assert "compiled for placement" in refused and "replan" in refused
