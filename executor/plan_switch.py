"""What a rank may switch to at a step boundary without registering its memory again.

An engine's expert placement changes (EPLB) and the planner edits the plan for it
(`planner/replan.py`): the regions, their sizes and the peers stay, only which bytes go
where changes. `Executor.switch_plan` keeps the bound tensors, their registration, the
transport and the imported peers, and takes the new plan's ops; `refusal` says why a plan
cannot be taken that way (one line naming what differs and the fix), before anything of
the executor changes.
"""

from __future__ import annotations

from schemas.header import PlanHeader
from schemas.plan import RankPlan


def plan_peers(plan: RankPlan) -> set[int]:
    """The ranks this rank's part writes to or signals with."""
    return (set(plan.writes["dst_rank"].tolist()) | set(plan.signals["peer"].tolist())
            | set(plan.waits["peer"].tolist()))


def refusal(old_header: PlanHeader, old: RankPlan, header: PlanHeader, new: RankPlan,
            peers: list[int]) -> str | None:
    """Why rank `old.rank` cannot switch from `old` to `new` in place (None: it can)."""
    me = f"rank {old.rank}: cannot switch plans in place"
    fix = "load the new plan instead (executor.load: it binds and registers again)"
    if new.rank != old.rank or new.role != old.role:
        return f"{me}: the new part is rank {new.rank} ({new.role}), not {old.rank}; {fix}"
    if (header.world, header.sources, header.targets) != (
            old_header.world, old_header.sources, old_header.targets):
        return (f"{me}: the new plan has {header.sources} sources and {header.targets} "
                f"targets, the loaded one {old_header.sources} and {old_header.targets}; {fix}")
    if header.placement_base != old_header.placement_base:
        return (f"{me}: the new plan is not the loaded one for another expert placement "
                f"(placement base {str(header.placement_base)[:16]!r}, loaded "
                f"{str(old_header.placement_base)[:16]!r}); {fix}")
    if new.identity != old.identity:
        return f"{me}: the new part was compiled for identity {new.identity}, not " \
               f"{old.identity}; {fix}"
    if new.regions != old.regions:
        i = next((i for i, (a, b) in enumerate(zip(old.regions, new.regions)) if a != b),
                 min(len(old.regions), len(new.regions)))
        what = new.regions[i] if i < len(new.regions) else "none"
        return f"{me}: region {i} differs ({what}, loaded " \
               f"{old.regions[i] if i < len(old.regions) else 'none'}); {fix}"
    if dict(new.peer_regions) != dict(old.peer_regions):
        return f"{me}: the peers' regions it writes differ; {fix}"
    extra = sorted(plan_peers(new) - set(peers))
    if extra:
        return f"{me}: the new plan talks to rank {extra[0]}, not connected; {fix}"
    return None
