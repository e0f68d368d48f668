"""One rank of the synthetic block-FP8 plan over NIXL (spawned by test_pipeline.py).

    python fp8_worker.py PLAN RANK HOST:PORT WORLD PACK_GROUPS

Sources generate the benchmark's weights (`bench.gpu_refit.weights`), targets start at
zero and check theirs against the reference quantizer after one step; a source prints how
many of its stages run their packs in groups. Exit status 0: every check passed.
"""

from __future__ import annotations

import sys

import torch

import executor
from bench.gpu_refit.weights import check_targets, generate
from harness.weights import DTYPES
from planner.fp8 import quantize_layout
from planner.spec import spec_from_hf
from tests.support.nixl_world import join, leave
from tests.support.synthetic import FP8_HF, fused_col_split, row_split


def main(path: str, rank: int, rendezvous: str, world: int, groups: int) -> int:
    spec = spec_from_hf(FP8_HF)
    src, dst = row_split(spec, 3), quantize_layout(fused_col_split(spec, 2, 2), spec)
    n = len(src.ranks)
    rl = src.ranks[rank] if rank < n else dst.ranks[rank - n]
    tensors = {pt.name: torch.zeros(pt.shape, dtype=DTYPES[pt.dtype]) for pt in rl.tensors}
    if rank < n:
        generate(tensors, rl, spec, seed=3)
    store = join(rendezvous, 120)
    plan = executor.load(path, rank, tensors, transport="nixl", rendezvous=store,
                         timeout_s=120, no_identity=True, pack_groups=groups)
    if rank < n:
        print(f"rank {rank} pipelined {sum(bool(st.pipeline) for st in plan.stages)}",
              flush=True)
    executor.run(plan)
    status = 0
    if rank >= n:
        bad = check_targets(tensors, rl, spec, 3)
        print(f"rank {rank} {'bit-exact' if not bad else 'differs: ' + str(bad[:3])}",
              flush=True)
        status = 1 if bad else 0
    leave(store, rank, world, 120)
    plan.close()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                  int(sys.argv[5])))
