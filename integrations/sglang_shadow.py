"""Shadow mode of the SGLang plugin (`integrations/sglang_engine.py`, whose docstring says
what it does and what SGLang 0.5.23 lacks for more): the scheduler method that starts the
receive into the shadow, the `begin_weight_update` of shadow mode, and the trainer's
`update_shadow`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from integrations.errors import TornUpdateError
from integrations.sglang import EngineRank, rank_state
from schemas.errors import UserError

log = logging.getLogger("integrations.sglang_engine")


def rdma_plan_shadow_start(scheduler: Any, finish_timeout_s: float | None = None) -> None:
    """Shadow mode: start this rank's part of the next step into the shadow and return; the
    scheduler keeps serving (an RPC method of the plugin: `engine.collective_rpc(
    "rdma_plan_shadow_start")`). `finish_timeout_s`: how long `begin_weight_update` then
    waits for the last DONE (None: the plan's timeout)."""
    state = rank_state(scheduler)
    if state is None or state.target.shadow is None:
        raise UserError("rdma_plan_shadow_start: this engine is not bound in shadow mode; "
                        "call rdma_plan_init(..., shadow=True) first")
    state.finish_timeout_s = finish_timeout_s
    state.target.begin()  # the engine's expert placement against the plan's, first
    state.target.start()


def shadow_begin(original: Callable, manager: Any, recv_req: Any, state: EngineRank) -> Any:
    """Shadow mode's `begin_weight_update` (generation paused): wait for the last DONE into
    the shadow; all TP ranks agree (a torn rank on any: none switches, the live weights keep
    the last version, generation may resume); SGLang's begin (restores packed weights), then
    the switch, shadow -> live in place. SGLang's end then post-processes them."""
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqOutput

    target = state.target
    assert target.shadow is not None, "bound with shadow=True"
    why = target.wait(state.finish_timeout_s) if target.shadow.running else \
        "no shadow update was started (rdma_plan_shadow_start)"
    flag = torch.tensor([0 if why else 1, target.rank], dtype=torch.int64)
    flags = [torch.zeros_like(flag) for _ in range(manager.tp_cpu_group.size())]
    torch.distributed.all_gather(flags, flag, group=manager.tp_cpu_group)
    torn = [int(f[1]) for f in flags if not int(f[0])]
    if torn:
        if not why:
            target.discard()
        msg = (f"rdma-plan: the shadow update did not complete on plan rank(s) {torn}"
               + (f" (this rank: {why})" if why else "") + "; nothing was switched: the "
               "engine keeps its last version, continue_generation resumes it")
        log.error("%s", msg)
        return BeginWeightUpdateReqOutput(success=False, message=msg)
    out = original(manager, recv_req)
    if out.success:
        target.switch()
        assert target.shadow.last is not None
        state.shadow_updates.append(target.shadow.last)
    else:
        target.discard()
    return out


def update_shadow(call: Callable[[str, dict[str, Any]], dict[str, Any]],
                  start: Callable[[], object], send: Callable[[], object], version: str,
                  empty_cache: bool = True) -> float:
    """One shadow-mode update of one engine (bound with `shadow=True`): `start()` (e.g.
    `lambda: engine.collective_rpc("rdma_plan_shadow_start")`) and the sources' `send()`
    while the engine keeps serving the last version, then pause, begin (the last DONE, all
    TP ranks agree, SGLang's begin, the switch), end (SGLang's post-processing, the prefix
    cache flushed), version and resume. Returns the pause: pause_generation to
    continue_generation answered, in seconds. A torn transfer raises `TornUpdateError`
    after resuming generation on the last version (nothing was switched)."""
    start()
    try:
        send()
    except Exception as e:  # noqa: BLE001  (the engine's begin decides and says why)
        log.error("rdma-plan: send failed: %s", e)
    t0 = time.perf_counter()
    call("pause_generation", {"mode": "in_place"})
    begun = call("begin_weight_update", {})
    if not begun.get("success"):
        call("continue_generation", {"torch_empty_cache": False})
        raise TornUpdateError(f"begin_weight_update refused: {begun.get('message')}; the "
                              f"engine resumed on its last version, not {version!r}")
    ended = call("end_weight_update", {})
    if not ended.get("success"):
        raise TornUpdateError(f"end_weight_update refused: {ended.get('message')}; the "
                              f"engine stays paused, version not set to {version!r}")
    call("update_weight_version", {"new_version": version, "abort_all_requests": False})
    call("continue_generation", {"torch_empty_cache": empty_cache})
    return time.perf_counter() - t0
