"""The SGLang plugin's plan switch (a replanned plan after an EPLB rebalance), both sides.

Engine side: `rdma_plan_switch(plan, version, check_only=False)`, one of the plugin's RPC
methods (`sglang_engine.METHODS`, answered by its AROUND hook on the scheduler's
`handle_rpc_request`, where `Engine.collective_rpc` lands on every TP rank): this rank's
part of `plan` checked (`engine_switch.py`: signature, identity, version strictly above the
running plan's, the plan's placement against SGLang's current `ExpertLocationMetadata`,
regions and peers) and, unless `check_only`, switched to, memory registered once. Refused
while an update is open or torn (switch between whole updates).

Trainer side: `switch(call, plan, path, version)` with the trainer's loaded source
`executor.Executor`: its own part checked, every TP rank's check (`check_only`), then every
TP rank switches (the RPC, on the caller's thread) while the trainer's executor does (on a
thread), each waiting for the other's record of the new plan. `call` is the update's
`Call`; SGLang 0.5.23 runs a plugin's RPC in process only (`in_process(engine)`, whose
"rpc" endpoint is `Engine.collective_rpc`), not over HTTP.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import executor
from executor.errors import PlanSwitchError
from executor.trust import check_identity
from integrations.sglang import rank_state, scheduler_state
from integrations.sglang_trainer import Call
from schemas.errors import UserError
from schemas.integrity import plan_key as read_key
from schemas.plan import load_rank

log = logging.getLogger(__name__)
METHOD = "rdma_plan_switch"


def rdma_plan_switch(scheduler: Any, plan: str, version: int, check_only: bool = False) -> None:
    """This TP rank's switch to the replanned `plan` (an RPC method: the module docstring)."""
    state = rank_state(scheduler)
    if state is None:
        raise UserError(f"{METHOD}: this engine is not bound; call rdma_plan_init first")
    where = f"SGLang target (plan rank {state.target.rank})"
    if scheduler_state(scheduler).session or state.thread is not None or state.torn:
        raise PlanSwitchError(f"{where}: {METHOD} while a weight update is open or torn "
                              f"({state.torn or 'session open'}); switch between whole "
                              "updates (after end_weight_update succeeded)")
    if check_only:
        state.target.check_switch(plan, version, where)
        return
    state.target.switch_plan(plan, version, where)
    log.info("rdma-plan: %s switched to %s (version %d)", where, plan, version)


def check(call: Call | None, plan: executor.Executor, path: str, version: int, *,
          plan_key: str | None = None, identity: dict | None = None,
          no_identity: bool = False) -> tuple[Any, Any]:
    """This trainer rank's part of `path` checked for a switch of `plan` (signature,
    identity, regions and peers) and, given `call`, every TP rank's (`check_only`: version
    and placement too); (header, part). Raises one line; nothing changes anywhere."""
    header, part = load_rank(path, plan.rank, None if plan_key is None else read_key(plan_key))
    check_identity(header, part.identity, plan.rank, identity, no_identity, path)
    plan.check_switch(header, part)
    if call is not None:
        checked = call("rpc", {"method": METHOD, "parameters": {
            "plan": path, "version": version, "check_only": True}})
        if not checked.get("success"):
            raise PlanSwitchError(f"{METHOD} refused by the engine: {checked.get('message')}"
                                  "; nothing switched")
    return header, part


def switch(call: Call | None, plan: executor.Executor, path: str, version: int, *,
           plan_key: str | None = None, identity: dict | None = None,
           no_identity: bool = False) -> None:
    """The trainer's side (module docstring): `plan`, this trainer rank's loaded executor,
    and every TP rank of the engine switch to `path`, version `version`. A refusal on any
    side raises (`PlanSwitchError`, one line) before anything switched anywhere. `call`
    None: this trainer rank's executor only (the ranks that do not drive the engine; have
    them agree with the driver's checks first, e.g. `check` on every rank, then a barrier)."""
    header, part = check(call, plan, path, version, plan_key=plan_key, identity=identity,
                         no_identity=no_identity)
    if call is None:
        plan.switch_plan(header, part)
        return
    body = {"method": METHOD, "parameters": {"plan": path, "version": version}}
    failed: list[BaseException] = []

    def own() -> None:  # on a thread: `call` stays on the caller's (in_process's ZMQ rule)
        try:
            plan.switch_plan(header, part)
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below
            failed.append(e)
    mine = threading.Thread(target=own, name="rdma-plan-switch", daemon=True)
    mine.start()
    try:
        answer = call("rpc", body)
    finally:
        mine.join(plan.timeout_s + 30.0)
    if failed:
        raise failed[0]
    if mine.is_alive():
        raise PlanSwitchError(f"rank {plan.rank}: its switch did not finish within "
                              f"{plan.timeout_s + 30.0:g} s")
    if not answer.get("success"):
        raise PlanSwitchError(f"{METHOD} failed on the engine after its check passed: "
                              f"{answer.get('message')}")
