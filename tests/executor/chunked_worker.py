"""One rank of a chunked-shadow refit of the tiny gpt-oss over NIXL (test_chunked_nixl.py).

    python chunked_worker.py PLAN RANK HOST:PORT

Ranks 0-1: FSDP2 sources; 2-3: vLLM TP 2 targets, each through a `ChunkedShadow` (UNPACKs
land in its buffer too). Step 1: every rank runs every chunk: the targets hold version 1,
bit-exact, pointers kept. Step 2: source 0 sends chunk 0 only (never chunk 1): the targets'
`run` raises `TornUpdateError` at chunk 1; chunk 0's tensors hold version 2, the others
version 1. Step 3: every rank runs: version 3, bit-exact. Exit 0: every check held (each
target prints what it saw).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from executor import TornUpdateError  # noqa: E402
from executor.chunked import ChunkedShadow, load_chunks, run_chunks  # noqa: E402
from harness.weights import materialize, random_full_tensors  # noqa: E402
from tests.support.nixl_world import join, leave  # noqa: E402
from tests.support.shadow_plans import CASES, layouts  # noqa: E402

TORN = 1
SPEC, SRC, DST = layouts(CASES[1])
N_SRC = SRC.world


def version(v: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of version `v` (sources: what they send; targets: what a
    complete refit of version `v` leaves, padding aside)."""
    full = random_full_tensors(SPEC, seed=v)
    return materialize(SRC, full)[rank] if rank < N_SRC else materialize(DST, full)[rank - N_SRC]


def _same(got: torch.Tensor, want: torch.Tensor, old: torch.Tensor) -> bool:
    """Bit-exact, but for bytes no op writes (padding), which keep `old`."""
    g, w, o = (x.reshape(-1).view(torch.uint8) for x in (got, want, old))
    d = g != w
    return bool(torch.equal(g[d], o[d]))


def target(rank: int, path: str, store: dist.TCPStore) -> int:
    live = {k: v.clone() for k, v in version(0, rank).items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    shadow = ChunkedShadow.load(path, rank, live, transport="nixl", rendezvous=store, timeout_s=90,
                                no_identity=True)
    chunk_of = {g.name: k for k, ex in enumerate(shadow.chunks) for g in ex.plan.regions}
    for ex in shadow.chunks:
        ex.timeout_s = 6.0
    _barrier(store, "loaded", rank)
    ok = True
    old = {k: v.clone() for k, v in live.items()}
    st = shadow.run(1)
    want = version(1, rank)
    ok &= _report(rank, 1, all(_same(live[k], want[k], old[k]) for k in live)
                  and {k: v.data_ptr() for k, v in live.items()} == ptrs,
                  f"bit-exact through {len(shadow.chunks)} chunks of {shadow.budget} bytes, "
                  f"pointers kept (switches {[f'{s:.1e}' for s in st.switch_s]} s)")
    v1 = {k: v.clone() for k, v in live.items()}
    try:
        shadow.run(2)
        ok &= _report(rank, 2, False, "completed without source 0's chunk 1")
    except TornUpdateError as e:
        want = version(2, rank)
        mixed = all(_same(live[k], want[k], v1[k]) if chunk_of[k] < TORN
                    else torch.equal(live[k], v1[k]) for k in live)
        ok &= _report(rank, 2, mixed and shadow.switched == TORN and shadow.version == 1,
                      f"torn at chunk {TORN}: chunks < {TORN} at version 2, the rest at "
                      f"version 1 ({str(e)[:60]}...)")
    _barrier(store, "step2", rank)
    st = shadow.run(3)
    want = version(3, rank)
    ok &= _report(rank, 3, all(_same(live[k], want[k], v1[k]) for k in live)
                  and st.version == 2, "whole again, bit-exact")
    leave(store, rank, 4, 120)
    shadow.close()
    return 0 if ok else 1


def _report(rank: int, step: int, ok: bool, what: str) -> bool:
    print(f"rank {rank} step {step}: {'OK' if ok else 'FAILED'} {what}", flush=True)
    return ok


def source(rank: int, path: str, store: dist.TCPStore) -> int:
    tensors = {k: v.clone() for k, v in version(1, rank).items()}
    chunks = load_chunks(path, rank, tensors, transport="nixl", rendezvous=store, timeout_s=90,
                         no_identity=True)
    for ex in chunks:
        ex.timeout_s = 12.0
    _barrier(store, "loaded", rank)
    for step in (1, 2, 3):
        for k, v in version(step, rank).items():
            tensors[k].copy_(v)
        if step == 3:
            _barrier(store, "step2", rank)
        try:
            run_chunks(chunks[:TORN] if (step, rank) == (2, 0) else chunks, step)
        except Exception as e:  # noqa: BLE001 - step 2: rank 1 waits for a READY never sent
            if step != 2:
                raise
            print(f"rank {rank} step 2: {type(e).__name__}", flush=True)
        print(f"rank {rank} step {step}: sent", flush=True)
    leave(store, rank, 4, 120)
    for ex in chunks:
        ex.close()
    return 0


def _barrier(store: dist.TCPStore, name: str, rank: int) -> None:
    store.set(f"{name}/{rank}", b"1")
    store.wait([f"{name}/{r}" for r in range(4)], timedelta(seconds=120))


def main(path: str, rank: int, rendezvous: str) -> int:
    return (source if rank < N_SRC else target)(rank, path, join(rendezvous, 120))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
