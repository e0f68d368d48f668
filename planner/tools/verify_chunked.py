"""`rdma-plan verify` of a chunked plan: a chunked shadow's chunk plans in one file
(`schemas/chunked_plan.py`).

Every check of `planner/tools/verify.py` runs on each chunk plan, then the file's own rules:
every chunk has the same ranks and roles; each target rank's chunks hold each tensor of the
index's set for that rank in exactly one chunk, so with each chunk's coverage every target
byte is written exactly once; each chunk lands at most N bytes on a target.
"""

from __future__ import annotations

from planner.tools.verify import verify_plan
from schemas.chunked_plan import load_chunked_index, set_violations
from schemas.plan import STAGING, Plan


def chunk_targets(p: Plan) -> dict[int, set[str]]:
    """Target rank -> the names of the tensors the chunk plan `p` writes on it."""
    return {rp.rank: {g.name for g in rp.regions if g.name != STAGING}
            for rp in p.ranks if rp.role == "target"}


def verify_chunked(path: str) -> list[str]:
    """Every chunk plan's violations (`verify_plan`, prefixed `chunk k:`), then the file's."""
    idx, budget, plans = load_chunked_index(path)
    out = [f"chunk {k}: {m}" for k, p in enumerate(plans) for m in verify_plan(p)]
    roles = [tuple(rp.role for rp in p.ranks) for p in plans]
    if len(set(roles)) > 1:
        out.append("the chunk plans have different ranks or roles; recompile the plan")
        return out
    targets = sorted(chunk_targets(plans[0]))
    for r in targets:
        out += set_violations(r, [p.ranks[r] for p in plans], idx.targets.get(r))
    if set(idx.targets) != set(targets):
        out.append(f"the chunk index states the tensors of target ranks "
                   f"{sorted(idx.targets)}, the chunks have targets {targets}; recompile the plan")
    for k, p in enumerate(plans):
        for r in chunk_targets(p):
            landed = sum(g.nbytes for g in p.ranks[r].regions if g.name != STAGING)
            if landed > budget:
                out.append(f"chunk {k}: lands {landed} bytes on target rank {r}, more than the "
                           f"{budget}-byte budget; recompile the plan")
    return out
