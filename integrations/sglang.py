"""SGLang engine side: write a plan's target ranks into a live SGLang 0.5.23 engine.

One `SGLangTarget` per SGLang scheduler process (one TP rank of one engine), built once
after the engine has loaded its model. It reads the rank's identity from SGLang's own
parallel state (`runtime_context.get_parallel()`), binds the live `named_parameters()`
and registers them once (`executor.load`); every update then writes straight into them.

One update, through SGLang's own calls (trainer side on the left, each engine rank on
the right; the engine's `collective_rpc` or a scheduler hook runs the right column):

    engine.pause_generation()
    engine.begin_weight_update()      target.begin()   WeightUpdater.begin_weight_update()
    sources: executor.run(plan)       target.receive() executor.run(plan) on this rank
    engine.end_weight_update()        target.end(v)    refuses a torn update, else
                                                       WeightUpdater.end_weight_update(
                                                       run_post_load=True): SGLang's
                                                       post_load_weights refreshes the
                                                       derived tensors (DeepSeek w_kc/w_vc)
                                                       in place, then commits version v
    engine.update_weight_version(v); engine.continue_generation()

SGLang's scheduler runs `post_load_weights` at `end_weight_update` exactly when no
`load_weights` ran in the session: the raw-write case. The plan header's `derived` entry
for this rank (`planner.layouts.sglang.derived`) lists what that refresh must cover; the
target checks at bind time that SGLang's model holds those tensors, so a plan compiled for
another model or engine version is refused before anything is registered.

Remote-instance memory registration: `weight_info()` returns SGLang's own
`{name: (data_ptr, numel, element_size)}` map (`register_memory_region_v1`'s format) of
the bound tensors; the pointers never change across updates.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

import executor
from executor import trust
from integrations import placement_check, tensor_sha256
from schemas.errors import UserError
from schemas.header import PlanHeader
from schemas.identity import find_rank
from schemas.integrity import plan_key as read_key
from schemas.plan import STAGING, open_plan, read_header


class TornUpdateError(executor.TornUpdateError):
    """The plan did not complete on this rank: the weights are not whole; nothing committed.
    (An operational failure, a peer lost mid-update, not bad input: no `UserError`; an
    `executor.TornUpdateError`.)"""


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


def plan_rank(header: PlanHeader, ident: dict[str, int | str], path: str = "plan") -> int:
    """The plan rank of an engine rank: the one whose recorded identity equals `ident`
    (`schemas.identity.find_rank`, which refuses an identity no rank holds, naming it and
    the plan's target config)."""
    return int(find_rank(header, ident, path))


def derived_of(header: PlanHeader, rank: int) -> list[dict[str, Any]]:
    """The plan's derived-refresh entries of plan rank `rank` (header key `derived`: one
    list per plan rank; absent or empty when nothing is derived)."""
    per_rank = header.derived
    entries = list(per_rank[rank]) if 0 <= rank < len(per_rank) else []
    return [e for e in entries if e.get("engine") == "sglang"]


def check_derived(model: torch.nn.Module, entries: list[dict[str, Any]]) -> None:
    """Every derived tensor the plan lists must exist on SGLang's model (after its first
    post-load processing); refuse otherwise, naming the tensor."""
    modules = dict(model.named_modules())
    missing = [f"{e['module']}.{w}" for e in entries for w in e["writes"]
               if not isinstance(getattr(modules.get(e["module"]), w, None), torch.Tensor)]
    if missing:
        raise UserError(f"derived: {missing[:3]} not found on the SGLang model; the plan "
                        "was compiled for another model or SGLang version: recompile it")


class SGLangTarget:
    """One SGLang engine rank bound to its plan rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, plan_path: str, *, updater: Any,
                 replica: int = 0, dp_rank: int = 0, transport: str = "nixl",
                 rendezvous: object = None, timeout_s: float = 60.0,
                 commit_version: Callable[[str], None] | None = None,
                 parallel: Any = None, plan_key: str | bytes | None = None,
                 allow_unsigned: bool = False, shadow: bool = False):
        trust.signing(plan_key, allow_unsigned, where=f"SGLang target ({plan_path})")
        key = None if plan_key is None else read_key(plan_key)
        with open_plan(plan_path) as f:
            header = read_header(f, plan_path, key)[0]
        engine = header.target.engine if header.target is not None else None
        if engine != "sglang":
            raise UserError(f"{plan_path}: target.engine is {engine!r}, not 'sglang'; "
                            "compile the plan with target.engine: sglang")
        self.model, self.updater, self.commit_version = model, updater, commit_version
        self.identity = identity(replica, dp_rank, parallel)
        self.rank = plan_rank(header, self.identity, plan_path)
        self.target_rank = self.rank - int(header.sources)
        """This rank in the plan's target layout (plan rank = sources + target rank)."""
        self.derived = derived_of(header, self.rank)
        self.placement = header.placement  # checked against SGLang's at each begin()
        check_derived(model, self.derived)
        self.tensors = {n: p.data for n, p in model.named_parameters()}
        self.shadow = executor.Shadow(self.tensors) if shadow else None
        """Shadow mode (`sglang_engine`): the plan writes this copy while SGLang serves."""
        bound = self.tensors if self.shadow is None else self.shadow.tensors
        self.plan = executor.load(plan_path, self.rank, bound, transport=transport,
                                  rendezvous=rendezvous, timeout_s=timeout_s,
                                  identity=self.identity, plan_key=plan_key)
        if self.shadow is not None:
            self.shadow.attach(self.plan)
        self.version: str | None = None
        self.open = False

    def written(self) -> list[str]:
        """The names of the tensors the plan writes on this rank (its regions)."""
        return [r.name for r in self.plan.plan.regions if r.name != STAGING]

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

    def begin(self) -> None:
        """SGLang's `begin_weight_update` on this rank (undoes in-place weight packing)."""
        placement_check.at_begin(self)  # the engine's experts where the plan writes them
        self.updater.begin_weight_update()
        self.open = True

    def receive(self) -> executor.RunStats:
        """This rank's part of one plan step; raises (naming the peer) if a peer is gone."""
        if not self.open:
            raise UserError("receive: no weight update is open; call begin() first")
        return executor.run(self.plan)

    def end(self, version: str) -> None:
        """SGLang's `end_weight_update` with post-load processing (derived state refreshed
        in place), then commit `version`; a torn update raises `TornUpdateError` and
        leaves the session open and the version unchanged (run the next update)."""
        if not self.open:
            raise UserError("end: no weight update is open; call begin() first")
        if not self.plan.complete:
            raise TornUpdateError(f"plan rank {self.rank}: the last update did not complete "
                                  "(a peer failed mid-step); the weights are not whole, "
                                  f"version stays {self.version!r}: do not resume generation; "
                                  "run receive() again, then end()")
        self.updater.end_weight_update(run_post_load=True)
        self.open = False
        self.version = version
        if self.commit_version is not None:
            self.commit_version(version)

    def close(self) -> None:
        self.plan.close()
