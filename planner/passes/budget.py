"""Each rank's staging budget, chosen from the cost model.

`options.staging_bytes` is a cap: no rank stages more. Below it the compiler picks, per rank:
- a source rank (trainer: its memory is free at refit time) may use all of the cap. Every
  stage boundary is a sync point of the whole plan (DONE, ACK; a stage ends on its most
  loaded pair), so a source stages as much per stage as the cap allows, and the fewer
  stages the closer the plan is to its floor. Staging is sized to need (`lower.slot_bases`), so a
  source that packs little allocates little;
- a target rank (inference: its memory serves KV cache) gets the least that keeps the
  write window full: a source keeps `INFLIGHT` writes in flight, and while a target
  unpacks one slot those writes must land in its other `SLOTS - 1` slots, so a slot holds
  `WINDOW_WRITES` of the largest staged write into the target, and no more. With fewer
  (a few large unpacked writes per slot, as gpt-oss's transposed experts make) the
  target's ingress idles at every boundary.
  A slot also holds enough that the target's stage boundaries (each a DONE, an unpack
  launch and an ACK: `boundary_s`) cost at most `BOUNDARY_SHARE` of its ingress time: a
  target that receives little keeps it all in one stage.
  A target that unpacks nothing gets no staging: it takes direct writes.
`budget_why` words the choice for `rdma-plan inspect`.
"""

from __future__ import annotations

import numpy as np

from schemas.config import Options
from schemas.protocol import ALIGN, INFLIGHT, SLOTS

WINDOW_WRITES = -(-INFLIGHT // (SLOTS - 1))
"""Staged writes a target's slot holds: the write window spread over the slots not being
unpacked."""


BOUNDARY_SHARE = 0.05
"""At most this share of a target's ingress time goes to its stage boundaries."""


def boundary_s(opts: Options) -> float:
    """Cost model: seconds one stage boundary adds on a target (DONE, unpack launch, ACK)."""
    return (2 * opts.write_overhead_us + opts.pack_overhead_us) * 1e-6


def target_slot(largest: np.ndarray | int, unpacked: np.ndarray | int,
                bytes_in: np.ndarray | int, opts: Options, nic_gbps: float) -> np.ndarray:
    """Bytes of one staging slot of targets whose largest staged write is `largest`, that
    unpack `unpacked` bytes and receive `bytes_in` in all: `WINDOW_WRITES` of the largest
    write, or more where that many stages would cost over `BOUNDARY_SHARE` of the ingress
    time (aligned)."""
    largest, unpacked = (np.asarray(x, dtype=np.int64) for x in (largest, unpacked))
    ingress_s = np.asarray(bytes_in, dtype=np.float64) * 8 / (nic_gbps * 1e9)
    b = boundary_s(opts)  # free boundaries (a zero cost model): the write window decides
    stages = np.maximum(1, np.floor(BOUNDARY_SHARE * ingress_s / b) if b > 0 else np.inf)
    slot = np.maximum(WINDOW_WRITES * largest, np.ceil(unpacked / stages).astype(np.int64))
    return np.where(unpacked > 0, -(-slot // ALIGN) * ALIGN, 0)


def budgets(world: int, sources: int, unpack_rank: np.ndarray, unpack_bytes: np.ndarray,
            bytes_in: np.ndarray, opts: Options, nic_gbps: float) -> np.ndarray:
    """Per plan rank: its staging budget (bytes). Ranks below `sources` are sources and get
    the cap (`opts.staging_bytes`); a target gets `SLOTS` slots of `target_slot`, at most
    the cap (`unpack_rank`, `unpack_bytes`: target rank and bytes of each staged write it
    unpacks; `bytes_in`: bytes each rank receives)."""
    r = np.asarray(unpack_rank, dtype=np.int64)
    n = np.asarray(unpack_bytes, dtype=np.int64)
    largest = np.zeros(world, dtype=np.int64)
    np.maximum.at(largest, r, n)
    unpacked = np.bincount(r, weights=n, minlength=world).astype(np.int64)
    out = np.full(world, opts.staging_bytes, dtype=np.int64)
    slot = target_slot(largest, unpacked, bytes_in, opts, nic_gbps)
    out[sources:] = np.minimum(SLOTS * slot[sources:], opts.staging_bytes)
    return out


def budget_why(role: str, largest: int, unpacked: int, bytes_in: int, opts: Options,
               nic_gbps: float) -> str:
    """Why a rank of `role` got its budget: the cap (sources), or for a target (`largest`:
    its largest staged write, `unpacked`: bytes it unpacks, `bytes_in`: bytes it receives)
    the write window or its boundary share."""
    cap = opts.staging_bytes
    if role != "target":
        return f"source, up to the cap ({cap / 2**20:g} MiB)"
    if unpacked <= 0:
        return "target, direct writes only"
    slot = int(target_slot(largest, unpacked, bytes_in, opts, nic_gbps))
    what = f"{WINDOW_WRITES} x its largest write ({largest / 1e6:.2f} MB)" \
        if slot <= -(-WINDOW_WRITES * largest // ALIGN) * ALIGN else \
        f"{unpacked / 1e6:.2f} MB unpacked in few enough stages"
    b = min(SLOTS * slot, cap)
    capped = " (the cap)" if b == cap else ""
    return f"target, slots of {what}: budget {b / 2**20:.1f} MiB{capped}"
