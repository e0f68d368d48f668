"""An engine rank's switch to a replanned plan at a step boundary, once for every engine.

After the engine moved its experts (EPLB) the trainer or its controller replans
(`planner.replan`: the regions stay, only which bytes go where changes) and asks every
engine rank, by the engine's own RPC (vLLM: `vllm_switch.RdmaPlanWorkerExtension`; SGLang:
the plugin's `rdma_plan_switch`), to switch to the new plan between two updates, memory
registered once (`executor.Executor.switch_plan`). Before anything of the running plan
changes, this rank's part of the new file is read and checked (`read`):

- the signature as at load (the engine core's `plan_key`), `target.engine` this engine's;
- the identity: the plan rank recorded for this rank's coordinates is the running one, and
  the part carries that identity (a part moved to another rank's slot is refused);
- the version: an integer strictly above the running plan's (0 for the plan bound at init),
  so a stale or replayed switch is refused even where its placement happens to match;
- the placement: the new plan's against the engine's CURRENT one, read from the engine
  (`placement_check.check`: one line naming the MoE layer, the physical slot and both
  experts, "nothing was written");
- the derived-state entries unchanged, and what the executor itself refuses (other
  regions, peers or placement base: `Executor.check_switch`).

`check` answers whether the switch would be taken and keeps the read part (`Pending`), so
an RPC in two phases (every rank checks, then every rank switches: no rank switches while
another refuses) reads the file once; `apply` re-checks the engine's placement (it may have
moved again in between) and switches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from executor.errors import PlanSwitchError
from executor.trust import check_identity
from integrations import placement_check
from integrations.errors import EngineMismatchError, StalePlanError
from schemas.chunked_plan import starts_chunked
from schemas.header import PlanHeader
from schemas.identity import find_rank
from schemas.integrity import plan_key as read_key
from schemas.placement import Placement
from schemas.plan import RankPlan, open_plan, read_header, read_rank

EnginePlacement = Callable[[Placement | None], Placement | None]
"""The engine's current expert placement, asked with the new plan's (SGLang's table has a
row per decoder layer: the plan's says how many of the last are MoE layers)."""


@dataclass(frozen=True)
class Pending:
    """A checked switch not yet taken: the new plan's header and this rank's part."""

    path: str
    version: int
    header: PlanHeader
    part: RankPlan


def check_version(version: object, running: int, path: str, where: str) -> int:
    """`version` as an int strictly above `running` (the running plan's), else one line."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise StalePlanError(f"{where}: plan version {version!r} of {path} is not an integer; "
                             f"give each replanned plan the next integer ({running + 1})")
    if version <= running:
        raise StalePlanError(f"{where}: plan version {version} of {path} is not newer than "
                             f"the running plan's {running}: a stale or repeated switch, "
                             "refused (nothing changed); replan for the engine's current "
                             f"placement and switch with version {running + 1} or more")
    return version


def read(core: Any, path: str, version: object, engine: EnginePlacement,
         where: str) -> Pending:
    """This rank's part of `path`, checked for a switch of `core` (its `EngineCore`: this
    module is imported by it) (the module docstring); raises one
    line (`StalePlanError`, `PlacementMismatchError`, `PlanSwitchError`,
    `EngineMismatchError`, the loader's own) and changes nothing."""
    if core.budget is not None or core.shadow is not None:
        mode = "a chunked plan" if core.budget is not None else "shadow mode"
        raise PlanSwitchError(f"{where}: this engine runs {mode}; a plan switch in place is "
                              "for the paused mode: shut the transfer engine down and init "
                              "it with the new plan")
    v = check_version(version, core.plan_version, path, where)
    key = None if core.plan_key is None else read_key(core.plan_key)
    with open_plan(path) as f:
        if starts_chunked(f):
            raise PlanSwitchError(f"{where}: {path} is a chunked plan; switch to a plan of "
                                  "the running one's kind (replan the running plan)")
        header, start = read_header(f, path, key)
        got = header.target.engine if header.target is not None else None
        if got != core.engine:
            raise EngineMismatchError(f"{where}: {path} has target.engine {got!r}, not "
                                      f"{core.engine!r}; replan the running plan")
        rank = int(find_rank(header, core.identity, path))
        if rank != core.rank:
            raise PlanSwitchError(f"{where}: {path} records this rank's identity "
                                  f"{core.identity} at plan rank {rank}, the running plan at "
                                  f"{core.rank}; replan the running plan")
        part = read_rank(f, header, start, rank, path)
    check_identity(header, part.identity, rank, core.identity, False, path)
    placement_check.check(engine(header.placement), header.placement, where)
    old = core.header.derived[rank] if rank < len(core.header.derived) else []
    new = header.derived[rank] if rank < len(header.derived) else []
    if list(map(dict, old)) != list(map(dict, new)):
        raise PlanSwitchError(f"{where}: {path} lists other derived tensors for plan rank "
                              f"{rank} than the running plan; init the transfer engine with it")
    if core.plan is None:
        raise PlanSwitchError(f"{where}: no plan is bound; init the transfer engine first")
    core.plan.check_switch(header, part)
    return Pending(path, v, header, part)


def apply(core: Any, pending: Pending, engine: EnginePlacement, where: str) -> None:
    """Switch `core`'s executor to the checked `pending` plan (the engine's placement read
    again first), then the core's header, part and version are the new plan's."""
    assert core.plan is not None, "read() checked it"
    now = engine(pending.header.placement)
    placement_check.check(now, pending.header.placement, where)
    core.plan.switch_plan(pending.header, pending.part,
                          now if pending.header.placement is not None else None)
    core.parts = [(pending.header, pending.part)]
    core.header, core.path = pending.header, pending.path
    core.placement, core.plan_version = pending.header.placement, pending.version
