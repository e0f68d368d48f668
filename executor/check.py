"""Load-time checks of one rank's plan, before anything is allocated, registered or posted.

The bounds proof itself (every op of every kind inside its regions, limits on what a plan
can make a process loop over) is `schemas.bounds`, shared with `rdma-plan verify`; here it
raises `PlanBoundsError`. Beside it: the rank against its plan's header, and the staging
the plan asks for against the memory the process has.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from schemas.bounds import violations
from schemas.header import PlanHeader
from schemas.plan import STAGING, RankPlan
from schemas.rankcheck import rank_violations

from .cleanup import best_effort
from .errors import PlanBoundsError

MAX_STAGING_BYTES = 4 << 30
"""Most staging a rank allocates unless the caller allows more (`Executor(...,
max_staging_bytes=)`): a plan's own cap (`options.staging_bytes`) is the plan's word, and
an unsigned plan's word is anyone's."""


def check_rank_plan(rp: RankPlan, world: int | None = None) -> None:
    """Raise `PlanBoundsError` unless every op of `rp` is inside its regions."""
    for msg in violations(rp, world):
        raise PlanBoundsError(msg)


def check_rank_verify(rp: RankPlan, header: PlanHeader) -> None:
    """Raise `PlanBoundsError` on the first per-rank check of `verify` that `rp` fails
    (`schemas.rankcheck`: roles, sizes, signals); run after `check_rank_plan`."""
    for msg in rank_violations(rp, header):
        raise PlanBoundsError(msg)


def check_against_header(rp: RankPlan, header: PlanHeader) -> None:
    """Raise `PlanBoundsError` unless `rp` agrees with its plan's header: the same stage
    count as every other rank, and every rank it names inside the world. A hand-built
    header may leave `stages` and `world` at 0 (unknown)."""
    if header.stages and rp.stages != header.stages:
        raise PlanBoundsError(f"rank {rp.rank}: has {rp.stages} stage(s), the plan's header "
                              f"says {header.stages}; every rank must walk the same stages: the "
                              "plan is corrupt, recompile it")
    world = header.world
    if not world:
        return
    if not 0 <= rp.rank < world:
        raise PlanBoundsError(f"rank {rp.rank}: outside the plan's world of {world} ranks")
    for name, col in (("write", rp.writes["dst_rank"]), ("signal", rp.signals["peer"]),
                      ("wait", rp.waits["peer"]),
                      ("peer_regions", np.array([p for p, _ in rp.peer_regions], dtype=np.int64))):
        bad = np.flatnonzero((col < 0) | (col >= world))
        if len(bad):
            raise PlanBoundsError(f"rank {rp.rank}: {name} {int(bad[0])} names rank "
                                  f"{int(col[bad[0]])}, outside the plan's world of {world} ranks "
                                  f"({len(bad)} such); the plan is corrupt, recompile it")


def free_bytes(device: Any) -> int:
    """Memory a new allocation can take on `device` (a torch device): free GPU memory, or
    the host's available memory (Linux `MemAvailable`; unbounded where unknown)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    got = best_effort("reading MemAvailable from /proc/meminfo", _meminfo_available)
    if got is not None:
        return got
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def check_staging(rp: RankPlan, tensors: dict[str, Any], header: PlanHeader | None = None,
                  cap: int | None = None) -> None:
    """Raise `PlanBoundsError` when the plan's staging is over the plan's own cap
    (`header.options.staging_bytes`), over `cap` (default `MAX_STAGING_BYTES`), or would not
    fit in the memory of the tensors' device (checked before `bind` allocates it)."""
    need = sum(r.nbytes for r in rp.regions if r.name == STAGING)
    if not need:
        return
    budget = None if header is None else header.options.staging_bytes
    if budget is not None and need > budget:
        raise PlanBoundsError(f"rank {rp.rank}: the plan asks for {need:,} bytes of staging, "
                              f"over its own options.staging_bytes={budget:,}; the plan is "
                              "corrupt or was tampered with: recompile it")
    cap = MAX_STAGING_BYTES if cap is None else cap
    if need > cap:
        raise PlanBoundsError(f"rank {rp.rank}: the plan asks for {need:,} bytes of staging, "
                              f"over this process's cap of {cap:,}; recompile with a smaller "
                              "options.staging_bytes, or allow more with "
                              "Executor(..., max_staging_bytes=N)")
    device = next((t.device for r in rp.regions if r.name != STAGING
                   and hasattr(t := tensors.get(r.name), "device")), "cpu")
    have = free_bytes(device)
    if need > have:
        raise PlanBoundsError(f"rank {rp.rank}: the plan asks for {need:,} bytes of staging, "
                              f"more than the {have:,} bytes free on {device}; recompile with "
                              "a smaller options.staging_bytes (or free memory)")


def _meminfo_available() -> int | None:
    """Linux `MemAvailable` in bytes (None where /proc/meminfo does not list it)."""
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None
