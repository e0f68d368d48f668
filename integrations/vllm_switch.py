"""The `rdma_plan` backend's plan switch (a replanned plan after an EPLB rebalance) in vLLM.

vLLM's weight-transfer API has no call for it, so the workers are reached through vLLM's
public worker extension: start the engine with
`worker_extension_cls="integrations.vllm_switch.RdmaPlanWorkerExtension"` (`vllm serve
--worker-extension-cls ...`), and `collective_rpc` runs its methods on every worker:

- `rdma_plan_placement()`: the engine's current expert placement (the
  `physical_to_logical_map` rows of its EPLB maps, or None with EPLB off): what the
  controller replans for (`planner.replan(plan, spec, Placement(table))`).
- `rdma_plan_switch(plan, version, check_only=False)`: this worker's part of `plan`, checked
  (`engine_switch.py`: signature, identity, version strictly above the running plan's, the
  plan's placement against the engine's current one, regions and peers) and, unless
  `check_only`, switched to between two updates (refused while an update is open), memory
  registered once. Answers the new plan's fingerprint.

The trainer side (`RdmaPlanTrainerEngine.check_switch` / `switch_plan`, which call `check`
and `switch` below) takes an `EngineRpc`, e.g. `lambda m, kw: llm.collective_rpc(m,
kwargs=kw)` (Ray: `ray.get(actor.collective_rpc.remote(m, kwargs=kw))`; a client with a
`collective_rpc(method, kwargs=...)` of its own is used as is). Every trainer rank first
checks (`check_switch`; the sender also has every worker check), the trainer agrees by its
own means (a barrier that fails if any rank raised), then every rank calls `switch_plan`:
the sender asks the workers to switch on a thread while its own executor switches, since
each waits for the other's record of the new plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from executor.errors import PlanSwitchError
from executor.trust import check_identity
from integrations import engine_switch, placement_check
from integrations.vllm_background import Background
from integrations.vllm_torn import agree
from schemas.integrity import plan_key as read_key
from schemas.plan import load_rank

log = logging.getLogger(__name__)

EngineRpc = Callable[[str, dict[str, Any]], Any]
"""Runs a worker method by name with keyword arguments on every worker of the engine."""
SWITCH = "rdma_plan_switch"
PLACEMENT = "rdma_plan_placement"


class RdmaPlanWorkerExtension:
    """vLLM worker extension (`worker_extension_cls`): the plan switch RPCs of `rdma_plan`.
    vLLM mixes it into its worker class; `weight_transfer_engine` is the worker's own."""

    weight_transfer_engine: Any

    def rdma_plan_switch(self, plan: str, version: int, check_only: bool = False) -> str:
        """Check, and unless `check_only` take, this worker's part of `plan` (module doc)."""
        return _backend(self).switch_plan(plan, version, check_only)

    def rdma_plan_placement(self) -> list[list[int]] | None:
        """The engine's current expert placement table (None: EPLB is off)."""
        p = placement_check.vllm_placement(_backend(self).model)
        return None if p is None else p.table.tolist()


def _backend(worker: Any) -> Any:
    """The worker's `RdmaPlanWeightTransferEngine` (`integrations/vllm.py`, which imports
    this module: known by its `switch_plan`), else one line."""
    eng = getattr(worker, "weight_transfer_engine", None)
    if not callable(getattr(eng, "switch_plan", None)) or not hasattr(eng, "core"):
        raise RuntimeError(f"{SWITCH}: this worker's weight-transfer engine is "
                           f"{type(eng).__name__}, not rdma_plan; start vLLM with "
                           "WeightTransferConfig(backend='rdma_plan')")
    return eng


def switch_worker(eng: Any, core: Any, plan: str, version: int, check_only: bool) -> str:
    """The worker side (`eng`: its `RdmaPlanWeightTransferEngine`, `core` its bound
    `EngineCore`). The workers agree (`vllm_torn.agree`, over vLLM's world group) after the
    check and after the switch: a refusal or failure on any worker is raised by the worker
    vLLM reads last only, naming every worker's reason (vLLM's `collective_rpc` stops at
    the first failed reply, so two raising workers would leave a stale reply queued), and
    no worker switches while another refuses. Answers the new plan's fingerprint."""
    where = f"rdma_plan worker {eng.identity.get('index')}"
    cause = ""
    try:
        if eng.session_open:
            raise RuntimeError(f"{where}: {SWITCH} while a weight update is open; switch "
                               "between updates (after finish_weight_update)")
        core.check_switch(plan, version, where)
    except Exception as e:  # noqa: BLE001 - agreed below, raised by one worker
        cause = f"{type(e).__name__}: {e}"
    if not _agreed(core, cause, f"{SWITCH} of {plan} refused, nothing switched"):
        return ""
    if check_only:
        return core.pending_switch.header.fingerprint
    try:
        core.switch_plan(plan, version, where)
        cause = ""
    except Exception as e:  # noqa: BLE001 - agreed below, raised by one worker
        cause = f"{type(e).__name__}: {e}"
    if not _agreed(core, cause, f"{SWITCH} of {plan} failed after every worker's check "
                   "passed"):
        return ""
    log.info("%s: switched to plan %s (version %d, fingerprint %s)", where, plan, version,
             core.header.fingerprint[:16])
    return core.header.fingerprint


def _agreed(core: Any, cause: str, what: str) -> bool:
    """Agree with the other workers: True when every one passed; else the last worker
    raises (`PlanSwitchError`, every worker's reason) and the others answer False (their
    pending switch dropped)."""
    ok, last, torn = agree(not cause, cause)
    if ok:
        return True
    core.pending_switch = None
    if last:
        raise PlanSwitchError(f"{what}: {'; '.join(torn)}")
    return False


def client_rpc(client: Any) -> EngineRpc | None:
    """An `EngineRpc` over a client that has `collective_rpc(method, kwargs=...)`."""
    rpc = getattr(client, "collective_rpc", None)
    return None if rpc is None else (lambda m, kw: rpc(m, kwargs=kw))


def check(eng: Any, plan: str, version: int, rpc: EngineRpc | None) -> Any:
    """Trainer rank `eng` (an `RdmaPlanTrainerEngine`): its part of `plan` checked as the
    workers check theirs (signature, identity, version, regions and peers); on the sender,
    every worker's check too (`check_only`). Returns (header, part); changes nothing."""
    info, where = eng.init_info, eng.init_info.where()
    if eng.open:
        raise RuntimeError(f"{where}: switch_plan while an update is open; call finish_send "
                           "first")
    assert eng.plan is not None, "trainer_init sets it"
    engine_switch.check_version(version, eng.plan_version, plan, where)
    header, part = load_rank(plan, eng.plan.rank, None if info.plan_key is None
                             else read_key(info.plan_key))
    check_identity(header, part.identity, eng.plan.rank, eng.identity, info.no_identity, plan)
    eng.plan.check_switch(header, part)
    if eng.is_sender:
        _rpc(eng, rpc, where)(SWITCH, {"plan": plan, "version": version, "check_only": True})
    return header, part


def switch(eng: Any, plan: str, version: int, rpc: EngineRpc | None) -> None:
    """Trainer rank `eng` switches to `plan` (checked first); the sender has every worker
    switch meanwhile (each side waits for the other's record of the new plan)."""
    header, part = check(eng, plan, version, rpc)
    if eng.is_sender:
        call = _rpc(eng, rpc, eng.init_info.where())
        with Background(eng.timeout_s, call, SWITCH,
                        {"plan": plan, "version": version, "check_only": False}):
            eng.plan.switch_plan(header, part)
    else:
        eng.plan.switch_plan(header, part)
    eng.plan_version = version


def _rpc(eng: Any, rpc: EngineRpc | None, where: str) -> EngineRpc:
    got = rpc or client_rpc(eng.client)
    if got is None:
        raise ValueError(f"{where}: the sender needs the engine's collective_rpc to switch "
                         "its workers: pass rpc=lambda m, kw: llm.collective_rpc(m, kwargs=kw)"
                         " (the engine started with worker_extension_cls="
                         "'integrations.vllm_switch.RdmaPlanWorkerExtension')")
    return got
