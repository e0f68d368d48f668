"""SGLang engine side: write a plan's target ranks into a live SGLang 0.5.23 engine.

One `SGLangTarget` per SGLang scheduler process (one TP rank of one engine), built once
after the engine has loaded its model. It reads the rank's identity from SGLang's own
parallel state (`runtime_context.get_parallel()`), binds the live `named_parameters()`
and registers them once (`executor.load`); every update then writes straight into them.

One update, through SGLang's own calls (trainer side on the left, each engine rank on
the right; the engine's `collective_rpc` or a scheduler hook runs the right column):

    engine.pause_generation()
    engine.begin_weight_update()    target.begin_weight_update(): EngineCore.begin() (the
                                    engine's expert placement against the plan's), then
                                    WeightUpdater.begin_weight_update()
    sources: executor.run(plan)     target.receive(): EngineCore.run_step() on this rank
    engine.end_weight_update()      target.end_weight_update(v): refuses a torn update, else
                                    WeightUpdater.end_weight_update(run_post_load=True):
                                    SGLang's post_load_weights refreshes the derived tensors
                                    (DeepSeek w_kc/w_vc) in place, then commits version v
    engine.update_weight_version(v); engine.continue_generation()

The plugin (`sglang_engine.py`) runs the same core calls from its hooks on SGLang's own
handlers (which call the `WeightUpdater` themselves): `begin()` before SGLang's begin, the
receive on a thread, the checks before SGLang's end.

SGLang's scheduler runs `post_load_weights` at `end_weight_update` exactly when no
`load_weights` ran in the session: the raw-write case. The plan header's `derived` entry
for this rank (`planner.layouts.sglang.derived`) lists what that refresh must cover; the
target checks at bind time that SGLang's model holds those tensors, so a plan compiled for
another model or engine version is refused before anything is registered.

A chunked plan (`target.shadow: {budget_bytes: N}`) is received the same way, paused: the
core binds a `executor.ChunkedShadow` of the live parameters and `run_step` lands each chunk
in its N-byte buffer and switches it into them before the next (the sources send with
`executor.run_chunks`). A chunk that never lands tears the update: the chunks before it
hold the new weights, it and the rest the old ones, `end` refuses it naming the chunk, and
the next `receive` starts again at chunk 0.

Remote-instance memory registration: `weight_info()` returns SGLang's own
`{name: (data_ptr, numel, element_size)}` map (`register_memory_region_v1`'s format) of
the bound tensors; the pointers never change across updates.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import executor
from integrations import placement_check, tensor_sha256
from integrations.engine_core import EngineCore
from integrations.errors import TornUpdateError
from schemas.errors import UserError


def identity(replica: int = 0, dp_rank: int = 0, parallel: Any = None) -> dict[str, int | str]:
    """This process's coordinates in SGLang's terms (the shared identity convention), from
    SGLang's own parallel state. `dp`: the attention DP rank with DP attention, else the
    engine's DP index `dp_rank` (SGLang's DP controller starts one engine per DP rank)."""
    if parallel is None:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
    dp = int(parallel.attn_dp_rank) if int(parallel.attn_dp_size) > 1 else dp_rank
    return {"framework": "sglang", "replica": replica, "dp": dp,
            "tp": int(parallel.tp_rank), "pp": int(parallel.pp_rank),
            "ep": int(parallel.moe_ep_rank), "attn_tp": int(parallel.attn_tp_rank)}


def check_derived(model: torch.nn.Module, entries: list[dict[str, Any]]) -> None:
    """Every derived tensor the plan lists must exist on SGLang's model (after its first
    post-load processing); refuse otherwise, naming the tensor."""
    modules = dict(model.named_modules())
    missing = [f"{e['module']}.{w}" for e in entries for w in e["writes"]
               if not isinstance(getattr(modules.get(e["module"]), w, None), torch.Tensor)]
    if missing:
        raise UserError(f"derived: {missing[:3]} not found on the SGLang model; the plan "
                        "was compiled for another model or SGLang version: recompile it")


class SGLangTarget(EngineCore):
    """One SGLang engine rank bound to its plan rank (see the module docstring): the
    engine core (`engine_core.py`) with SGLang's identity, derived-state check and
    weight-update calls."""

    def __init__(self, model: torch.nn.Module, plan_path: str, *, updater: Any,
                 replica: int = 0, dp_rank: int = 0, transport: str = "nixl",
                 rendezvous: object = None, timeout_s: float = 60.0,
                 commit_version: Callable[[str], None] | None = None,
                 parallel: Any = None, plan_key: str | bytes | None = None,
                 allow_unsigned: bool = False, shadow: bool = False):
        super().__init__(plan_path, "sglang", lambda _: identity(replica, dp_rank, parallel),
                         placement=placement_check.sglang_current,
                         plan_key=plan_key, allow_unsigned=allow_unsigned,
                         where=f"SGLang target ({plan_path})")
        self.model, self.updater, self.commit_version = model, updater, commit_version
        self.target_rank = self.rank - int(self.header.sources)
        """This rank in the plan's target layout (plan rank = sources + target rank)."""
        self.derived = [e for e in self.derived if e.get("engine") == "sglang"]
        check_derived(model, self.derived)
        self.tensors = {n: p.data for n, p in model.named_parameters()}
        """The live parameters; shadow mode (`sglang_engine`): the plan writes a shadow of
        them while SGLang serves."""
        self.open = False
        self.load(self.tensors, shadow=self.tensors if shadow else None, transport=transport,
                  rendezvous=rendezvous, timeout_s=timeout_s)

    def digests(self) -> dict[str, str]:
        """sha256 of the bytes of every tensor the plan writes on this rank, as the engine
        holds them now (`integrations.tensor_sha256`; compare with `layout_digests` of
        the plan's target layout built from the trainer's tensors)."""
        return {n: tensor_sha256(self.tensors[n]) for n in self.written()}

    def write_digests(self, out: str) -> str:
        """Write `digests()` with this rank's target rank, plan rank and identity as JSON to
        `out/rank<target rank>.json` (atomically); returns the path."""
        body = {"rank": self.target_rank, "plan_rank": self.rank, "identity": self.identity,
                "digests": self.digests()}
        path = os.path.join(out, f"rank{self.target_rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(body, f)
        os.replace(path + ".tmp", path)
        return path

    def weight_info(self) -> dict[str, tuple[int, int, int]]:
        """SGLang's remote-instance registration map of the bound tensors."""
        return {n: (t.data_ptr(), t.numel(), t.element_size()) for n, t in self.tensors.items()}

    def begin_weight_update(self, version: str | None = None) -> None:
        """The core's new update (the engine's expert placement checked first), then
        SGLang's `begin_weight_update` on this rank (undoes in-place weight packing)."""
        self.begin(version)
        self.updater.begin_weight_update()
        self.open = True

    def receive(self) -> executor.RunStats | executor.ChunkedStats:
        """This rank's part of one plan step (a chunked plan: every chunk, each switched
        into the live tensors before the next lands); raises what tore it (naming the peer,
        or the chunk and which chunks were switched)."""
        if not self.open:
            raise UserError("receive: no weight update is open; call begin_weight_update() "
                            "first")
        if not self.run_step():
            raise self.failure or TornUpdateError(
                f"plan rank {self.rank}: the plan step did not complete")
        assert self.stats is not None
        return self.stats

    def end_weight_update(self, version: str) -> None:
        """SGLang's `end_weight_update` with post-load processing (derived state refreshed
        in place), then commit `version`; a torn update raises `TornUpdateError` and
        leaves the session open and the version unchanged (run the next update)."""
        if not self.open:
            raise UserError("end_weight_update: no weight update is open; call "
                            "begin_weight_update() first")
        if not self.complete:
            raise TornUpdateError(f"plan rank {self.rank}: the last update did not complete "
                                  "(a peer failed mid-step); the weights are not whole, "
                                  f"version stays {self.version!r}: do not resume generation; "
                                  "run receive() again, then end_weight_update()")
        self.updater.end_weight_update(run_post_load=True)
        self.open = False
        self.commit(version)
        if self.commit_version is not None:
            self.commit_version(version)


JOIN_MARGIN_S = 30.0
"""How long `end_weight_update` waits for the receive beyond the plan's own timeout."""


@dataclass
class EngineRank:
    """The rdma-plan state of one bound scheduler process (`rank_state`): its target and
    the update the plugin's hooks run on it."""

    target: SGLangTarget
    thread: threading.Thread | None = None
    error: BaseException | None = None
    torn: str | None = None
    """Why the weights are not whole (None when they are): generation must not resume."""
    steps: list[executor.RunStats | executor.ChunkedStats] = field(default_factory=list)
    shadow_updates: list[executor.ShadowStats] = field(default_factory=list)
    """Shadow mode: per switched update, its transfer and pause (the switch) seconds."""
    finish_timeout_s: float | None = None

    def receive(self) -> None:
        """This rank's step (every chunk of a chunked plan) through the engine core; what
        tore it is reported by `end_weight_update`."""
        try:
            if self.target.run_step():
                assert self.target.stats is not None
                self.steps.append(self.target.stats)
            else:
                self.error = self.target.failure
        except BaseException as e:  # noqa: BLE001  (reported by end_weight_update)
            self.error = e

    def start(self) -> None:
        """Arm this rank's receive on a thread (the core's `begin` has run)."""
        self.error = None
        self.torn = "a weight update is in progress"
        self.thread = threading.Thread(target=self.receive, name="rdma-plan-receive",
                                       daemon=True)
        self.thread.start()

    def finish(self) -> str | None:
        """Wait for the receive; None when this rank's step is whole, else why not."""
        thread, self.thread = self.thread, None
        assert thread is not None
        thread.join(self.target.step_timeout_s() + JOIN_MARGIN_S)
        if thread.is_alive():
            self.thread = thread
            return "the receive is still running"
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        return None if self.target.complete else "the plan step did not complete"


@dataclass
class SchedulerState:
    """What the plugin knows of one SGLang scheduler: its bound rank, and what its hooks
    saw of SGLang's public calls (so nothing reads SGLang's private fields)."""

    rank: EngineRank | None = None
    """Set by `rdma_plan_init` (None: not bound)."""
    paused: bool = False
    """`pause_generation` ran and `continue_generation` has not since."""
    session: bool = False
    """SGLang's weight-update session is open: its `begin_weight_update` succeeded and no
    `end_weight_update` has since."""


_SCHEDULERS: weakref.WeakKeyDictionary[Any, SchedulerState] = weakref.WeakKeyDictionary()


def scheduler_state(scheduler: Any) -> SchedulerState:
    """The plugin's state of `scheduler` (made at its first use)."""
    state = _SCHEDULERS.get(scheduler)
    if state is None:
        state = _SCHEDULERS[scheduler] = SchedulerState()
    return state


def rank_state(scheduler: Any) -> EngineRank | None:
    """The bound rank of `scheduler` (None: `rdma_plan_init` has not run there)."""
    state = _SCHEDULERS.get(scheduler)
    return None if state is None else state.rank
