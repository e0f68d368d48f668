"""One rank of the 2 x 2 example over NIXL, targets through a `Shadow` (test_shadow.py).

    python shadow_worker.py PLAN RANK HOST:PORT

Step 1: the sources wait until both targets started, then 1 s more, then write; meanwhile
the targets check that their live tensors keep version 0 (all 7.0), then finish and switch.
Step 2: source 0 never runs: the targets' finish raises `TornUpdateError` and the live
tensors keep version 1. Step 3: every rank runs; the targets switch to version 3.
Exit 0: every check held (each target prints what it saw).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import executor
from tests.support.nixl_world import join, leave
from tests.support.plans import two_by_two_expected, two_by_two_tensors


def _equal(live: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(live[k], v) for k, v in want.items())


def target(rank: int, path: str, store: dist.TCPStore) -> int:
    live = {k: torch.full_like(v, 7.0) for k, v in two_by_two_tensors(0)[rank].items()}
    v0 = {k: v.clone() for k, v in live.items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    shadow = executor.Shadow.load(path, rank, live, transport="nixl", rendezvous=store,
                                  timeout_s=90, no_identity=True)
    assert shadow.executor is not None
    shadow.executor.timeout_s = 3.0
    shadow.start(1)
    store.set(f"started/{rank}", b"1")
    checks = 0
    while shadow.running and shadow._thread is not None and shadow._thread.is_alive():
        if not _equal(live, v0):
            print(f"rank {rank} step 1: live changed during the transfer", flush=True)
            return 1
        checks += 1
        time.sleep(0.01)
    shadow.finish(30)
    if not _equal(live, v0):
        print(f"rank {rank} step 1: live changed before switch", flush=True)
        return 1
    print(f"rank {rank} step 1: live kept version 0 during the transfer ({checks} checks)",
          flush=True)
    if not _switched(rank, shadow, live, ptrs, 1):
        return 1
    v1 = {k: v.clone() for k, v in live.items()}
    shadow.start(2)
    try:
        shadow.finish(30)
        print(f"rank {rank} step 2: finished without source 0", flush=True)
        return 1
    except executor.TornUpdateError as e:
        if not _equal(live, v1) or shadow.version != 1:
            print(f"rank {rank} step 2: live changed by a torn update", flush=True)
            return 1
        print(f"rank {rank} step 2: torn, live kept version 1 ({e})", flush=True)
    store.set(f"torn/{rank}", b"1")
    shadow.start(3)
    shadow.finish(60)
    ok = _switched(rank, shadow, live, ptrs, 3)
    leave(store, rank, 4)
    shadow.close()
    return 0 if ok else 1


def _switched(rank: int, shadow: executor.Shadow, live: dict[str, torch.Tensor],
              ptrs: dict[str, int], step: int) -> bool:
    pause = shadow.switch()
    if not _equal(live, two_by_two_expected(step)[rank]):
        print(f"rank {rank} step {step}: live differs after switch", flush=True)
        return False
    if {k: v.data_ptr() for k, v in live.items()} != ptrs:
        print(f"rank {rank} step {step}: a live tensor moved", flush=True)
        return False
    print(f"rank {rank} step {step}: switched, bit-exact, pointers kept (pause {pause:.2e} s)",
          flush=True)
    return True


def source(rank: int, path: str, store: dist.TCPStore) -> int:
    tensors = dict(two_by_two_tensors(0)[rank])
    plan = executor.load(path, rank, tensors, transport="nixl", rendezvous=store,
                         timeout_s=90, no_identity=True)
    plan.timeout_s = 30.0
    for step in (1, 2, 3):
        for k, v in two_by_two_tensors(step)[rank].items():
            tensors[k].copy_(v)
        if step == 1:
            store.wait(["started/2", "started/3"], timedelta(seconds=60))
            time.sleep(1.0)
        if step == 2 and rank == 0:
            continue  # never sends: the targets' update is torn
        if step == 3:
            store.wait(["torn/2", "torn/3"], timedelta(seconds=60))
        plan.run(step)
        print(f"rank {rank} step {step}: sent", flush=True)
    leave(store, rank, 4)
    plan.close()
    return 0


def main(path: str, rank: int, rendezvous: str) -> int:
    return (source if rank < 2 else target)(rank, path, join(rendezvous))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
