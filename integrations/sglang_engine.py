"""rdma-plan inside a live SGLang 0.5.23 engine, through SGLang's own weight-update calls.

An SGLang general plugin (entry point group `sglang.srt.plugins`, name `rdma_plan`:
`register`). SGLang runs `load_plugins()` in every scheduler process before it builds the
scheduler; `register` adds six hooks through SGLang's `HookRegistry` (AROUND hooks;
nothing in SGLang is edited, nothing is set on its classes). One is on the scheduler's
`handle_rpc_request`, where `Engine.collective_rpc` lands on every TP rank: it answers the
plugin's four methods (`METHODS`) by name, as SGLang answers its own, and passes every
other request to SGLang's handler:

- `rdma_plan_init(plan, rendezvous, transport, timeout_s, replica)`: bind this
  TP rank's live parameters to its plan rank and register them once (`SGLangTarget`).
  Reach it with `engine.collective_rpc("rdma_plan_init", plan=...)` (SGLang broadcasts an
  RPC to every TP rank and runs it there), or set `RDMA_PLAN_SGLANG` to the same keys as
  JSON in the server's environment (bound at the first `begin_weight_update`).
- `begin_weight_update` (scheduler): refused unless generation is paused, and (before
  SGLang's own begin, by the engine core's `begin`) when SGLang's expert placement is not
  the plan's; after SGLang's own begin, this rank starts receiving its plan step in a
  background thread (the scheduler keeps serving control requests meanwhile) through the
  engine core's `run_step`: a chunked plan's every chunk, each switched into the live
  parameters before the next lands, the engine paused throughout.
- `end_weight_update` (scheduler): waits for the receive, then all TP ranks agree
  (a MIN all-reduce over SGLang's TP CPU group: every rank answers the same). A torn step
  on any rank is refused before SGLang's end runs: `success=False` naming the ranks, the
  session stays open (the next `begin_weight_update` re-arms the receive: a retry),
  nothing is committed. A whole step runs SGLang's end, whose post-load processing
  refreshes the derived tensors (DeepSeek `w_kc`/`w_vc`) in place, then flushes SGLang's
  prefix cache (SGLang's session end keeps the KV the old weights computed; its own
  `update_weights_from_*` flush it). SGLang refuses the flush while requests run or are
  held in place by the pause: then the answer is `success=False` with `NOT_FLUSHED`
  (weights written, cache not flushed), and the trainer's `update` raises
  `CacheNotFlushedError` (not `TornUpdateError`: the weights are whole).
- `update_weight_version` and `continue_generation` (scheduler) are skipped while the
  weights are torn: the label stamped on outputs keeps the last whole version and the
  engine stays paused; `status(scheduler)["torn"]` says why.
- `rdma_plan_digests(out)`: each TP rank writes the sha256 of every tensor the
  plan writes on it, as it holds them, to `out/rank<target rank>.json`; `engine_digests`
  reaches it through `engine.collective_rpc` (SGLang's RPC answers no values) and reads
  the files: compare with `harness.weights.layout_digests` of the plan's target layout.

- `rdma_plan_switch(plan, version, check_only=False)`: between whole updates, this rank's
  part of a replanned plan (after SGLang's EPLB moved experts) checked against SGLang's
  current placement and switched to, memory registered once (`sglang_switch.py`; the
  trainer's side is `sglang_switch.switch`).

**Shadow mode** (`rdma_plan_init(..., shadow=True)`, a plan compiled with `target.shadow:
full` so the switch copies the plan's bytes only): the rank binds an `executor.Shadow` of
its parameters. `rdma_plan_shadow_start` (reach it with
`engine.collective_rpc("rdma_plan_shadow_start")`; SGLang's scheduler runs RPCs between
batches, so generation goes on) starts the receive into the shadow; the engine serves the
live weights meanwhile. With generation paused, `begin_weight_update` waits for the last
DONE, all TP ranks agree, then SGLang's own begin (`restore_weights_before_loading`: the
plan's bytes are the loaded form) and the switch, shadow -> live in place; `end_weight_update`
runs SGLang's post-processing and flushes the prefix cache. A torn transfer on any rank:
begin refused, nothing switched, the engine resumes on its last version. What SGLang
0.5.23 lacks for more: (1) no HTTP endpoint runs a plugin's scheduler method while it
serves (`Engine.collective_rpc` is in-process only; `begin_weight_update`, the one update
call over HTTP, restores packed weights on the live model at once, so it must run paused):
over HTTP the receive cannot be started without pausing, only from an in-process
`sglang.Engine` (or a channel of the plugin's own); (2) its post-load processing
(`post_load_weights`, `postprocess_weights`) and the restore run inside the pause, on the
live weights: the pause is the switch plus those, not the switch alone.

The trainer drives an update with `update(call, send, version)` (shadow mode:
`integrations.sglang_shadow.update_shadow(call, start, send, version)`); `call` posts one of
SGLang's HTTP endpoints (`http(url)`) or calls an in-process `sglang.Engine`
(`in_process(engine)`), `send` runs the sources' `executor.run(plan)`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from executor.rendezvous import store_at
from integrations.sglang import EngineRank, SGLangTarget, rank_state, scheduler_state
from integrations.sglang_shadow import rdma_plan_shadow_start, shadow_begin
from integrations.sglang_switch import rdma_plan_switch
from integrations.sglang_trainer import NOT_FLUSHED
from schemas.errors import UserError

log = logging.getLogger(__name__)
ENV = "RDMA_PLAN_SGLANG"
"""JSON of `rdma_plan_init`'s keys, read by a server started without the RPC."""


def rdma_plan_init(scheduler: Any, plan: str, rendezvous: str = "", transport: str = "nixl",
                   timeout_s: float = 60.0, replica: int = 0, plan_key: str | None = None,
                   allow_unsigned: bool = False, shadow: bool = False,
                   rendezvous_hosted: bool = False) -> None:
    """Bind this scheduler's target model to its plan rank (an RPC method, `METHODS`).
    `plan_key`: path of the plan's signing key (with a job secret set, required unless
    `allow_unsigned`). `shadow`: shadow mode (the module docstring). `rendezvous_hosted`:
    a store already runs at `rendezvous` (the job's): connect to it as a client, host none."""
    from sglang.srt.runtime_context import get_parallel

    if rank_state(scheduler) is not None:
        raise UserError(f"rdma_plan_init: this engine is already bound (plan rank "
                        f"{rank_state(scheduler).target.rank}); start a new engine")
    runner = dict(scheduler.tp_worker.weight_update_runners())["target"]
    parallel = get_parallel()
    target = SGLangTarget(runner.model, plan, updater=runner.weight_updater,
                          replica=int(replica), dp_rank=int(parallel.dp_rank or 0),
                          transport=transport,
                          rendezvous=store_at(rendezvous, bool(rendezvous_hosted),
                                              float(timeout_s)) if rendezvous else None,
                          timeout_s=float(timeout_s), parallel=parallel,
                          plan_key=plan_key, allow_unsigned=bool(allow_unsigned),
                          shadow=bool(shadow))
    scheduler_state(scheduler).rank = EngineRank(target)


def _bound(scheduler: Any) -> EngineRank | None:
    if rank_state(scheduler) is None and os.environ.get(ENV):
        try:
            keys = json.loads(os.environ[ENV])
        except ValueError as e:
            raise UserError(f"{ENV}: not JSON ({e}); set it to e.g. "
                            '{"plan": "/plans/x.rplan", "rendezvous": "host:port"}') from e
        rdma_plan_init(scheduler, **keys)
    return rank_state(scheduler)


def begin_hook(original: Callable, manager: Any, recv_req: Any) -> Any:
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqOutput

    scheduler = manager.scheduler
    try:
        state = _bound(scheduler)
    except Exception as e:  # noqa: BLE001  (an answer, not a crashed scheduler loop)
        return BeginWeightUpdateReqOutput(success=False, message=f"rdma-plan: binding "
                                          f"{ENV} failed: {type(e).__name__}: {e}")
    plugin = scheduler_state(scheduler)
    if state is None:
        return _session(plugin, original(manager, recv_req), True)
    if not plugin.paused:
        return BeginWeightUpdateReqOutput(success=False, message=(
            "rdma-plan: generation is running; call pause_generation first"))
    if state.target.shadow is not None:
        return _session(plugin, shadow_begin(original, manager, recv_req, state), True)
    try:  # the core's new update (the expert placement), before SGLang opens a session
        state.target.begin()
    except Exception as e:  # noqa: BLE001  (an answer, not a crashed scheduler loop)
        return BeginWeightUpdateReqOutput(success=False, message=f"rdma-plan: "
                                          f"{type(e).__name__}: {e}")
    if plugin.session and state.thread is None and state.torn:
        state.start()  # retry of a refused (torn) update: the session is still open
        return BeginWeightUpdateReqOutput(success=True, message="rdma-plan: receive re-armed")
    out = _session(plugin, original(manager, recv_req), True)
    if out.success:
        state.start()
    return out


def _session(plugin: Any, out: Any, opened: bool) -> Any:
    """SGLang's answer `out` to begin (`opened`) or end: its session is open after a begin
    that succeeded, closed after an end that did."""
    if out.success:
        plugin.session = opened
    return out


def end_hook(original: Callable, manager: Any, recv_req: Any) -> Any:
    from sglang.srt.managers.io_struct import EndWeightUpdateReqOutput

    plugin = scheduler_state(manager.scheduler)
    state = plugin.rank
    if state is None or not plugin.session:
        return _session(plugin, original(manager, recv_req), False)
    if state.thread is None:  # no receive armed: refused before, or none was started
        if state.torn:
            return EndWeightUpdateReqOutput(success=False, message=f"rdma-plan: {state.torn}")
        out = _session(plugin, original(manager, recv_req), False)
        return _flushed(manager, out) if state.target.shadow is not None else out
    why = state.finish()
    flag = torch.tensor([0 if why else 1, state.target.rank], dtype=torch.int64)
    flags = [torch.zeros_like(flag) for _ in range(manager.tp_cpu_group.size())]
    torch.distributed.all_gather(flags, flag, group=manager.tp_cpu_group)
    torn = [int(f[1]) for f in flags if not int(f[0])]
    if torn:
        state.torn = (f"the update did not complete on plan rank(s) {torn}"
                      + (f" (this rank: {why})" if why else "")
                      + "; the weights are not whole: begin_weight_update and send again")
        log.error("rdma-plan: end_weight_update refused: %s", state.torn)
        return EndWeightUpdateReqOutput(success=False, message=f"rdma-plan: {state.torn}")
    out = _session(plugin, original(manager, recv_req), False)
    if out.success:
        state.torn = None
    return _flushed(manager, out)


def _flushed(manager: Any, out: Any) -> Any:
    """After SGLang's end: its session end keeps the prefix (radix) KV cache that the old
    weights computed, so a cached prompt would decode with stale keys and values. Flush it,
    as SGLang's own update_weights_from_* calls do (flush_cache=True)."""
    from sglang.srt.managers.io_struct import EndWeightUpdateReqOutput

    if out.success and not manager.flush_cache():
        log.error("rdma-plan: %s (requests running or held in place)", NOT_FLUSHED)
        return EndWeightUpdateReqOutput(success=False, message=(
            f"{NOT_FLUSHED}: the update's weights are whole on every rank and SGLang's "
            "post-load ran, but its prefix cache (computed with the old weights) was "
            "not flushed because requests are running or held in place by the pause"))
    return out


def pause_hook(original: Callable, scheduler: Any, recv_req: Any) -> Any:
    """SGLang's `pause_generation`, then this rank knows the engine is paused."""
    out = original(scheduler, recv_req)
    scheduler_state(scheduler).paused = True
    return out


def continue_hook(original: Callable, scheduler: Any, recv_req: Any) -> Any:
    state = rank_state(scheduler)
    if state is not None and state.torn:
        log.error("rdma-plan: continue_generation skipped (the engine stays paused): %s",
                  state.torn)
        return None
    out = original(scheduler, recv_req)
    scheduler_state(scheduler).paused = False
    return out


def version_hook(original: Callable, scheduler: Any, recv_req: Any) -> Any:
    from sglang.srt.managers.io_struct import UpdateWeightVersionReqOutput

    state = rank_state(scheduler)
    if state is not None and state.torn:
        log.error("rdma-plan: weight_version %r not recorded: %s", recv_req.new_version,
                  state.torn)
        return UpdateWeightVersionReqOutput()
    return original(scheduler, recv_req)


def status(scheduler: Any) -> dict[str, Any]:
    """This rank's rdma-plan state: bound, plan rank, steps received, why torn."""
    state = rank_state(scheduler)
    if state is None:
        return {"bound": False}
    return {"bound": True, "rank": state.target.rank, "steps": len(state.steps),
            "receiving": state.thread is not None, "torn": state.torn,
            "shadow": [{"step": u.step, "version": u.version, "transfer_s": u.transfer_s,
                        "pause_s": u.pause_s, "switched_bytes": u.switched_bytes}
                       for u in state.shadow_updates]}


def rdma_plan_digests(scheduler: Any, out: str) -> None:
    """`SGLangTarget.write_digests(out)` on this TP rank (an RPC method, `METHODS`,
    for `collective_rpc`: every TP rank runs it)."""
    state = rank_state(scheduler)
    if state is None:
        raise UserError("rdma_plan_digests: this engine is not bound; call rdma_plan_init "
                        "first")
    state.target.write_digests(out)


METHODS: dict[str, Callable[..., None]] = {
    "rdma_plan_init": rdma_plan_init,
    "rdma_plan_shadow_start": rdma_plan_shadow_start,
    "rdma_plan_digests": rdma_plan_digests,
    "rdma_plan_switch": rdma_plan_switch,
}
"""The plugin's scheduler methods by RPC name (`rpc_hook` runs them)."""


def rpc_hook(original: Callable, scheduler: Any, recv_req: Any) -> Any:
    """SGLang's `handle_rpc_request` (what `Engine.collective_rpc` reaches on every TP
    rank), answering the plugin's own methods (`METHODS`) as SGLang answers its own: the
    method with the request's parameters, its error logged and answered as
    `success=False`, then the TP ranks' barrier SGLang's handler ends with; any other
    method goes to SGLang's handler."""
    from sglang.srt.managers.io_struct import RpcReqOutput

    method = METHODS.get(recv_req.method)
    if method is None:
        return original(scheduler, recv_req)
    error: Exception | None = None
    try:
        method(scheduler, **(recv_req.parameters or {}))
    except Exception as e:  # noqa: BLE001  (answered, as SGLang answers its own methods)
        error = e
        log.error("rdma-plan: rpc %s failed: %s", recv_req.method, e)
    torch.distributed.barrier(group=scheduler.tp_group.cpu_group)
    return RpcReqOutput(success=error is None, message="" if error is None else str(error))


HOOKS = {
    "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request": rpc_hook,
    "sglang.srt.managers.scheduler_components.weight_updater."
    "SchedulerWeightUpdaterManager.begin_weight_update": begin_hook,
    "sglang.srt.managers.scheduler_components.weight_updater."
    "SchedulerWeightUpdaterManager.end_weight_update": end_hook,
    "sglang.srt.managers.scheduler.Scheduler.pause_generation": pause_hook,
    "sglang.srt.managers.scheduler.Scheduler.continue_generation": continue_hook,
    "sglang.srt.managers.scheduler.Scheduler.handle_update_weight_version": version_hook,
}


def register() -> None:
    """The plugin's entry point: SGLang calls it in every process, then applies hooks.
    Everything goes through SGLang's `HookRegistry`; nothing is set on its classes."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for path, hook in HOOKS.items():
        HookRegistry.register(path, hook, HookType.AROUND)
