"""The executor over CUDA IPC: 4 processes on one GPU (IPC handles work across processes
of one device too), the 2 x 2 example, several steps, bit-exact, with DONE sent by the GPU
(`device_signals`) and by the host. Run on the device:
`pytest -m gpu tests/executor/test_cuda_ipc.py`."""

from __future__ import annotations

import ast
import json
import os
import secrets
import subprocess
import sys

import pytest
import torch

from harness.launch import master_store, root_env, spawn_ranks
from tests.support.plans import save, two_by_two

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "bench", "executor_bench.py")

pytestmark = pytest.mark.gpu


def _three_steps(tmp_path, options: dict, **env: str) -> tuple[dict, list]:
    """The 2x2 plan's four ranks over cuda_ipc (rank r on GPU r % GPUs), three steps each,
    every one bit-exact (the worker checks); each rank's transport stats, and the ranks."""
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    store, port = master_store(60)  # noqa: F841 (alive while the ranks run)
    gpus = torch.cuda.device_count()
    done = spawn_ranks(lambda r: [sys.executable, WORKER, path, str(r), f"127.0.0.1:{port}",
                                  "3", "cuda_ipc", f"cuda:{r % gpus}", "90",
                                  json.dumps(options)], 4,
                       env=root_env(RDMA_PLAN_SECRET=secrets.token_hex(32), **env),
                       timeout=240)
    for f in done:
        assert f.returncode == 0, f"rank {f.rank} failed:\n{f.output[-3000:]}"
        assert f"rank {f.rank} step 3: ok" in f.output
    stats = {f.rank: json.loads(f.output.split(f"rank {f.rank} stats ", 1)[1].splitlines()[0])
             for f in done}
    return stats, done


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", [True, False], ids=["copy-kernel", "copy-engines"])
def test_four_processes_over_cuda_ipc(tmp_path, kernel):
    # the copy kernel's run sends DONE from the GPU (device_signals), the engines' from the host
    gpus = torch.cuda.device_count()
    stats, done = _three_steps(tmp_path, {"copy_kernel": kernel, "device_signals": kernel})
    # the best path throughout: posts through raw runtime calls, nothing fell back (a
    # fallback is recorded with its reason in `CudaIpcTransport.degraded`)
    for f in done:
        s = stats[f.rank]
        assert s["posting_mode"] == 2 and s["degraded"] == 0, (s, f.output[-2000:])
    sent = sum(s["device_signals"] for s in stats.values())
    assert (sent > 0) == kernel, stats  # the GPU published DONEs, and only where asked to
    if gpus > 1 and kernel:  # rank 1 writes ranks 2 and 3; those on another GPU than
        # its own (2 GPUs: rank 2 on cuda:0; 4 GPUs: both) it maps itself
        s = stats[1]
        other = [p for p in (2, 3) if p % gpus != 1 % gpus]
        # (its batches into them: one cuMemcpyBatchAsync each where the driver has it)
        assert s["peers_mapped_here"] == len(other), s
        assert s["kernel_batches"] + s["batch_api_batches"] > 0, s
        # rank 2's three small regions share one allocation of the caching allocator: one
        # open of its handle, not one per region (rank 3 has one region)
        regions = sum({2: 3, 3: 1}[p] for p in other)
        assert s["regions_mapped_here"] == regions and s["handles_opened_here"] < regions, s


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", [True, False], ids=["copy-kernel", "copy-engines"])
def test_writes_wait_for_what_the_caller_queued_before_run(tmp_path, kernel):
    # the sources refill their tensors on the current stream behind ~20 ms of GPU work, so
    # the refill has not run when run() starts: the posts (`ordered_posts`) must still copy
    # the refilled bytes, every step
    stats, done = _three_steps(tmp_path, {"copy_kernel": kernel}, WORKER_LAGGED_REFILL="1")
    for f in done:  # the fast path (raw runtime calls), nothing fell back
        s = stats[f.rank]
        assert s["posting_mode"] == 2 and s["degraded"] == 0, (s, f.output[-2000:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mib,options,engines", [
    (4, {}, True),  # every copy 4 MiB: the copy engines, one CUDA graph
    (1, {}, False),  # 1 MiB copies: the copy kernel
    (4, {"engines_min_bytes": 8 << 20}, False),  # under the option's length: the kernel
    (4, {"graph_branches": 3}, True),  # uneven branches: 3, 3 and 2 copies
    (4, {"graph_branches": 16}, True),  # more branches than copies: one copy each
], ids=["4MiB-engines", "1MiB-kernel", "4MiB-under-option", "3-branches", "16-branches"])
def test_long_copies_into_this_gpu_go_to_the_copy_engines(mib, options, engines):
    # two processes on one GPU (executor_bench: 8 writes into permuted slots, 2 steps,
    # bit-exact or it exits non-zero); rank 0's transport says which path its batch took
    out = subprocess.run([sys.executable, BENCH, "--transport", "cuda_ipc", "--device", "cuda",
                          "--writes", "8", "--mib", str(mib), "--steps", "2",
                          "--transport-options", json.dumps(options)],
                         env=root_env(CUDA_VISIBLE_DEVICES=os.environ.get(
                             "CUDA_VISIBLE_DEVICES", "0").split(",")[0]),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = out.stdout.split("transport stats: ", 1)[1].splitlines()[0]
    s = ast.literal_eval(line)
    assert (s["engine_graphs"], s["kernel_batches"]) == ((1, 0) if engines else (0, 1)), s
    assert s["posting_mode"] == 2 and s["degraded"] == 0, s
