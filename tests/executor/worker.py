"""One rank of the 2 x 2 example as its own process (spawned by test_nixl.py and
test_cuda_ipc.py).

    python worker.py PLAN RANK HOST:PORT STEPS [TRANSPORT [DEVICE [TIMEOUT_S [OPTIONS]]]]

(OPTIONS: the transport's options as JSON.)

Sources refill their tensors with the data of step k before each run(); targets check
their tensors bit-exactly after each run(). Exit status 0 means every step matched; a
rank with STEPS 0 loads and never runs; a `PeerTimeoutError` prints the peer, exits 3.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import executor
from tests.support.nixl_world import join, leave
from tests.support.plans import two_by_two_expected, two_by_two_tensors


def main(path: str, rank: int, rendezvous: str, steps: int, transport: str = "nixl",
         device: str = "cpu", timeout_s: str = "90", options: str = "{}") -> int:
    store = join(rendezvous)
    tensors = {k: t.to(device) for k, t in two_by_two_tensors(0)[rank].items()}
    plan = executor.load(path, rank, tensors, transport=transport, rendezvous=store,
                         timeout_s=90, transport_options=json.loads(options) or None,
                         no_identity=True)  # the test numbers the ranks itself
    plan.timeout_s = float(timeout_s)  # loading may wait for slow peers; steps may not
    try:
        status = _steps(plan, rank, tensors, steps)
    except executor.PeerTimeoutError as e:
        print(f"rank {rank}: PeerTimeoutError peer={e.peer} complete={plan.complete}: {e}",
              flush=True)
        status = 3
    if transport == "cuda_ipc":  # which paths it took (test_cuda_ipc.py reads them)
        print(f"rank {rank} stats {json.dumps(plan.transport.stats())}", flush=True)
        print(f"rank {rank} degraded {plan.transport.degraded}", flush=True)  # why, if any
    leave(store, rank, 4)
    plan.close()
    return status


def _steps(plan: executor.Executor, rank: int, tensors: dict[str, torch.Tensor],
           steps: int) -> int:
    lagged = os.environ.get("WORKER_LAGGED_REFILL") and plan.device.type == "cuda"
    for step in range(1, steps + 1):
        if rank in (0, 1) and lagged:  # the refill queued behind ~20 ms of GPU work on the
            # current stream, not done when run() starts: the writes must wait for it
            new = {k: t.to(plan.device) for k, t in two_by_two_tensors(step)[rank].items()}
            torch.cuda.synchronize(plan.device)
            torch.cuda._sleep(40_000_000)
            for name, t in new.items():
                tensors[name].copy_(t)
        elif rank in (0, 1):
            for name, t in two_by_two_tensors(step)[rank].items():
                tensors[name].copy_(t)
        stats = executor.run(plan)
        if rank in (2, 3):
            for name, want in two_by_two_expected(step)[rank].items():
                if not torch.equal(tensors[name].cpu(), want):
                    print(f"rank {rank} step {step}: {name} differs", flush=True)
                    return 1
        if not 0 <= stats.waited <= stats.seconds:
            print(f"rank {rank} step {step}: waited {stats.waited} of {stats.seconds} s",
                  flush=True)
            return 1
        print(f"rank {rank} step {step}: ok {stats.bytes} B", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), *sys.argv[5:]))
