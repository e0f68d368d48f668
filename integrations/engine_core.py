"""The engine side of a plan, once for every engine: what vLLM's backend (`vllm.py`) and the
SGLang plugin (`sglang.py`, `sglang_engine.py`) share, each adapting it with what differs.

One `EngineCore` per engine rank (a vLLM worker, an SGLang TP rank), in this order:

1. **Read once.** The plan's signature policy (`executor.trust.signing`), then the header
   and this rank's part from one open file: the header's `target.engine` must be this
   engine's; the adapter's `locate(header)` derives the rank's identity from the engine's
   own parallel state (and makes its own checks against the header), the plan rank is the
   one recorded for that identity (`schemas.identity.find_rank`), and its part is read
   from the same file (`schemas.plan.read_rank`). A chunked plan (`schemas/chunked_plan.py`,
   compiled with `target.shadow: {budget_bytes: N}`) is read the same way from the same
   open file: chunk 0's header locates the rank, and its part of every chunk is read
   (`schemas.chunked_plan.read_rank_chunks`); `parts` holds them in order.
2. **Bind.** `load(tensors, shadow)`, one of three modes: the executor binds the engine's
   live tensors (paused), or an `executor.Shadow` of them (shadow: `shadow` names the
   tensors the shadow copies), or, for a chunked plan, an `executor.ChunkedShadow` of them
   (chunked: one buffer of N bytes, one executor per chunk); each registers once and
   connects, the identity checked against every part before anything is registered.
3. **Receive.** `begin(version)` opens each update, before anything is written: the engine's
   expert placement, read by the adapter's `placement` (given at init, the same reader a
   plan switch asks), against the plan's (`placement_check.check`: one line naming the MoE
   layer and slot), then nothing received, nothing torn. Paused: `run_step()` runs this
   rank's step into the live tensors; whether it completed, and why not (`failure`).
   Chunked: `run_step()` too, with the engine paused across it: each chunk lands in the
   buffer and is switched into the live tensors before the next (until it returns the live
   tensors hold a mix of versions; a torn chunk leaves that mix, `failure` says which chunks
   were switched, and the next `run_step` starts again at chunk 0). Shadow: `start()` runs
   it on a thread into the shadow while the engine serves; `wait(timeout_s)` waits for the
   last DONE (None, or why the update is torn); `switch()` copies shadow -> live in place,
   `discard()` drops a complete shadow step that another rank tore.
4. **Switch plans** (between updates, paused mode): `check_switch(path, version, where)`
   reads and checks this rank's part of a replanned plan (identity, version strictly newer,
   the new plan's placement against the engine's current one, what the executor refuses)
   and keeps it; `switch_plan` takes it (`engine_switch.py`), memory registered once.
5. **Refresh, check, commit or tear**: the engine's own (vLLM: `vllm_checks.refreshers`,
   `vllm_content.check`; SGLang: its `end_weight_update` post-load), then `commit(version)`,
   or a `TornUpdateError` with nothing committed. The update's state (`pending`,
   `failure`, `received`, `torn_open`, `landed`, `wait_s`, the last step's `stats`; whether
   this rank's step is `complete`) lives here, every field set in
   `__init__`, so the engine helpers (`vllm_shadow.py`, `vllm_torn.py`) read and set the
   core's fields, not the engine object's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import executor
from executor import LoadOptions, trust
from integrations import engine_switch, placement_check
from integrations.errors import EngineMismatchError
from schemas.chunked_plan import read_rank_chunks, starts_chunked
from schemas.header import PlanHeader
from schemas.identity import find_rank
from schemas.integrity import plan_key as read_key
from schemas.plan import STAGING, RankPlan, Region, open_plan, read_header, read_rank

Locate = Callable[[PlanHeader], dict[str, int | str]]
"""The adapter's identity of this engine rank in the plan's terms, from the engine's own
state (it may refuse the header first, naming what differs)."""


class EngineCore:
    """One engine rank's plan: read once, bound, received into, committed or torn."""

    def __init__(self, path: str, engine: str, locate: Locate, *,
                 placement: engine_switch.EnginePlacement,
                 plan_key: str | bytes | None = None, allow_unsigned: bool = False,
                 where: str = "") -> None:
        where = where or f"{engine} target ({path})"
        trust.signing(plan_key, allow_unsigned, where=where)
        key = None if plan_key is None else read_key(plan_key)
        found: list[dict[str, int | str]] = []

        def rank_of(header: PlanHeader) -> int:
            got = header.target.engine if header.target is not None else None
            if got != engine:
                raise EngineMismatchError(f"{path}: target.engine is {got!r}, not {engine!r}; "
                                          f"compile the plan with target.engine: {engine}")
            found.append(locate(header))
            return int(find_rank(header, found[0], path))
        with open_plan(path) as f:
            budget: int | None = None
            if starts_chunked(f):
                budget, parts = read_rank_chunks(f, path, rank_of, key)
            else:
                header, start = read_header(f, path, key)
                parts = [(header, read_rank(f, header, start, rank_of(header), path))]
        self.budget = budget
        """A chunked plan's buffer, in bytes (None: the plan is not chunked)."""
        self.path, self.plan_key, self.engine, self.where = path, plan_key, engine, where
        self.engine_placement = placement
        """The adapter's reader of the engine's current expert placement (asked with a
        plan's), checked at every `begin` and plan switch."""
        self.parts: list[tuple[PlanHeader, RankPlan]] = parts
        """This rank's part of the plan with its header: one, or one per chunk in order."""
        self.header: PlanHeader = parts[0][0]
        """The plan's header (a chunked plan's chunks share its engine, ranks, identities)."""
        self.rank = parts[0][1].rank
        """This engine rank's plan rank."""
        self.identity = found[0]
        """Its coordinates in the plan's terms (`schemas/identity.py`)."""
        self.derived: list[dict[str, Any]] = []
        """The headers' derived-state entries of this rank (the engine refreshes them)."""
        for h, _ in parts:
            for e in (h.derived[self.rank] if self.rank < len(h.derived) else ()):
                if e not in self.derived:
                    self.derived.append(dict(e))
        self.placement = self.header.placement
        """The expert placement the plan writes (checked against the engine's per update)."""
        self.plan: executor.Executor | None = None
        self.shadow: executor.Shadow | None = None
        self.chunked: executor.ChunkedShadow | None = None
        """Chunked mode: the buffer and one executor per chunk (`load`)."""
        self.version: str | None = None
        """The last committed version (None before the first complete update)."""
        self.pending: str | None = None
        """The open update's version."""
        self.failure: BaseException | None = None
        """Why the open update is torn on this rank (None: it is not)."""
        self.received = False
        """Every rank of the engine received the open update whole (agreed)."""
        self.torn_open = False
        """Torn and agreed; the engine kept this rank's session open for a close."""
        self.landed: bool | None = None
        """Shadow mode: the agreed outcome of waiting for the last DONE (None: not asked)."""
        self.wait_s = 0.0
        """Shadow mode: the last wait for the last DONE."""
        self.stats: executor.RunStats | executor.ChunkedStats | None = None
        """The last step `run_step` completed on this rank (chunked: its chunks' stats)."""
        self.plan_version = 0
        """The running plan's version: 0 for the plan bound at init, then each switch's."""
        self.pending_switch: engine_switch.Pending | None = None
        """A switch `check_switch` accepted and `switch_plan` has not taken yet."""

    @property
    def part(self) -> RankPlan:
        """This rank's part of an ordinary plan (a chunked plan has one per chunk: `parts`)."""
        if self.budget is not None:
            raise ValueError(f"{self.path}: a chunked plan has one part per chunk; read "
                             "EngineCore.parts or regions()")
        return self.parts[0][1]

    def regions(self) -> list[Region]:
        """The tensors the plan writes on this rank, staging left out: each chunk's in
        order for a chunked plan."""
        return [g for _, rp in self.parts for g in rp.regions if g.name != STAGING]

    def written(self) -> list[str]:
        """The names of the tensors the plan writes on this rank (its regions)."""
        return [g.name for g in self.regions()]

    def load(self, tensors: dict[str, torch.Tensor], *, shadow: dict[str, torch.Tensor] | None
             = None, transport: str = "nixl", rendezvous: object = None,
             timeout_s: float = 60.0) -> executor.Executor | executor.ChunkedShadow:
        """Bind `tensors` (or, given `shadow`, an `executor.Shadow` of those live tensors;
        for a chunked plan, an `executor.ChunkedShadow` of them), register once and connect
        to the peers."""
        opts = LoadOptions(transport=transport, rendezvous=rendezvous, timeout_s=timeout_s,
                           plan_key=self.plan_key, identity=self.identity)
        if self.budget is not None:
            if shadow is not None:
                raise ValueError(f"{self.path}: a chunked plan streams through its own "
                                 f"{self.budget}-byte buffer: load it without a shadow and "
                                 "receive it paused (run_step), or compile with "
                                 "target.shadow: full for the shadow mode")
            self.chunked = executor.ChunkedShadow.load_parts(self.budget, self.parts, tensors,
                                                             opts, self.path)
            return self.chunked
        if shadow is not None:
            self.shadow = executor.Shadow(shadow)
            tensors = self.shadow.tensors
        header, part = self.parts[0]
        self.plan = executor.Executor.load_part(header, part, tensors, opts, self.path)
        if self.shadow is not None:
            self.shadow.attach(self.plan)
        return self.plan

    def begin(self, version: str | None = None) -> None:
        """A new update, before anything is written: the engine's expert placement against
        the plan's (`PlacementMismatchError` in one line, nothing changed), then nothing
        received, nothing torn."""
        placement_check.check(self.engine_placement(self.placement), self.placement,
                              self.where)
        self.pending, self.failure, self.received, self.torn_open = version, None, False, False
        self.landed = None

    def run_step(self) -> bool:
        """Paused mode: this rank's step into the live tensors; chunked mode: every chunk's
        step, each switched into the live tensors before the next lands (keep the engine
        paused: until it returns they hold a mix of versions). Whether it completed (else
        the error is `failure`)."""
        chunked, plan = self.chunked, self.plan
        assert chunked is not None or plan is not None, "load() first"
        try:
            self.stats = chunked.run() if chunked is not None else executor.run(plan)
        except Exception as e:  # noqa: BLE001 - kept: the engine agrees and reports it
            self.failure = e
        return self.complete

    @property
    def complete(self) -> bool:
        """This rank's last step landed whole and nothing tore it (`failure`): paused, its
        executor's step completed; chunked, every chunk was switched."""
        if self.failure is not None:
            return False
        if self.chunked is not None:
            return self.chunked.last is not None and self.chunked.switched == len(
                self.chunked.chunks)
        return self.plan is not None and self.plan.complete

    def step_timeout_s(self) -> float:
        """How long one `run_step` may wait on its peers before it fails: the executor's
        timeout; a chunked plan's chunks run one after another, each with its own."""
        if self.chunked is not None:
            return sum(ex.timeout_s for ex in self.chunked.chunks)
        assert self.plan is not None, "load() first"
        return self.plan.timeout_s

    def start(self) -> None:
        """Shadow mode: this rank's step into the shadow, on a thread; returns at once."""
        assert self.shadow is not None, "load(..., shadow=...) first"
        self.shadow.start()

    def wait(self, timeout_s: float | None = None) -> str | None:
        """Shadow mode: wait for the step's last DONE; None when it completed, else why not
        (the error kept in `failure`)."""
        assert self.shadow is not None, "load(..., shadow=...) first"
        if not self.shadow.running:
            return "no shadow update was started"
        try:
            self.shadow.finish(timeout_s)
        except executor.TornUpdateError as e:
            self.failure = e
            return str(e)
        return None

    def switch(self) -> float:
        """Shadow mode: shadow -> live in place (every `data_ptr` kept); the pause, s."""
        assert self.shadow is not None, "load(..., shadow=...) first"
        return self.shadow.switch()

    def discard(self) -> None:
        """Shadow mode: drop a complete step another rank tore (nothing switches)."""
        assert self.shadow is not None, "load(..., shadow=...) first"
        self.shadow.discard()

    def check_switch(self, path: str, version: int, where: str) -> engine_switch.Pending:
        """Read and check this rank's part of the replanned plan `path` for a switch
        (`engine_switch.read`, against the engine's current placement), keep it for
        `switch_plan`; raises one line and changes nothing when it would be refused."""
        self.pending_switch = None
        self.pending_switch = engine_switch.read(self, path, version, self.engine_placement,
                                                 where)
        return self.pending_switch

    def switch_plan(self, path: str, version: int, where: str) -> None:
        """Between updates: run `path` (version `version`) from the next update on, memory
        registered once; every peer switches too (`Executor.switch_plan` waits for them).
        The part `check_switch` kept for the same path and version is taken, else it is
        read and checked now."""
        p = self.pending_switch
        if p is None or (p.path, p.version) != (path, version):
            p = self.check_switch(path, version, where)
        self.pending_switch = None
        engine_switch.apply(self, p, self.engine_placement, where)

    def commit(self, version: str | None) -> None:
        """Every byte landed and the engine refreshed and checked: `version` is committed."""
        self.version, self.received = version, False

    def close(self) -> None:
        if self.chunked is not None:
            self.chunked.close()
            self.chunked = None
        if self.shadow is not None:
            self.shadow.join()  # its thread uses the executor
            self.shadow = None
        if self.plan is not None:
            self.plan.close()
            self.plan = None
