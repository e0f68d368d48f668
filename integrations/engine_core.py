"""The engine side of a plan, once for every engine: what vLLM's backend (`vllm.py`) and the
SGLang plugin (`sglang.py`, `sglang_engine.py`) share, each adapting it with what differs.

One `EngineCore` per engine rank (a vLLM worker, an SGLang TP rank), in this order:

1. **Read once.** The plan's signature policy (`executor.trust.signing`), then the header
   and this rank's part from one open file: the header's `target.engine` must be this
   engine's; the adapter's `locate(header)` derives the rank's identity from the engine's
   own parallel state (and makes its own checks against the header), the plan rank is the
   one recorded for that identity (`schemas.identity.find_rank`), and its part is read
   from the same file (`schemas.plan.read_rank`).
2. **Bind.** `load(tensors, shadow)`: the executor binds the engine's live tensors (paused
   mode) or an `executor.Shadow` of them (shadow mode: `shadow` names the tensors the
   shadow copies), registers once and connects (`Executor.load_part`, the identity checked
   against the part before anything is registered).
3. **Receive.** Paused: `run_step()` runs this rank's step into the live tensors; whether it
   completed, and why not (`failure`). Shadow: `start()` runs it on a thread into the
   shadow while the engine serves; `wait(timeout_s)` waits for the last DONE (None, or why
   the update is torn); `switch()` copies shadow -> live in place, `discard()` drops a
   complete shadow step that another rank tore.
4. **Refresh, check, commit or tear**: the engine's own (vLLM: `vllm_checks.refreshers`,
   `vllm_content.check`; SGLang: its `end_weight_update` post-load), then `commit(version)`,
   or a `TornUpdateError` with nothing committed. The update's state (`pending`,
   `failure`, `received`, `torn_open`, `landed`, `wait_s`) lives here, every field set in
   `__init__`, so the engine helpers (`vllm_shadow.py`, `vllm_torn.py`) read and set the
   core's fields, not the engine object's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import executor
from executor import LoadOptions, trust
from integrations.errors import EngineMismatchError
from schemas.header import PlanHeader
from schemas.identity import find_rank
from schemas.integrity import plan_key as read_key
from schemas.plan import STAGING, RankPlan, open_plan, read_header, read_rank

Locate = Callable[[PlanHeader], dict[str, int | str]]
"""The adapter's identity of this engine rank in the plan's terms, from the engine's own
state (it may refuse the header first, naming what differs)."""


class EngineCore:
    """One engine rank's plan: read once, bound, received into, committed or torn."""

    def __init__(self, path: str, engine: str, locate: Locate, *,
                 plan_key: str | bytes | None = None, allow_unsigned: bool = False,
                 where: str = "") -> None:
        trust.signing(plan_key, allow_unsigned, where=where or f"{engine} target ({path})")
        key = None if plan_key is None else read_key(plan_key)
        with open_plan(path) as f:
            header, start = read_header(f, path, key)
            got = header.target.engine if header.target is not None else None
            if got != engine:
                raise EngineMismatchError(f"{path}: target.engine is {got!r}, not {engine!r}; "
                                          f"compile the plan with target.engine: {engine}")
            identity = locate(header)
            rank = int(find_rank(header, identity, path))
            part = read_rank(f, header, start, rank, path)
        self.path, self.plan_key, self.engine = path, plan_key, engine
        self.header: PlanHeader = header
        self.part: RankPlan = part
        self.rank = rank
        """This engine rank's plan rank."""
        self.identity = identity
        """Its coordinates in the plan's terms (`schemas/identity.py`)."""
        per_rank = header.derived
        self.derived: list[dict[str, Any]] = list(per_rank[rank]) if rank < len(per_rank) \
            else []
        """The header's derived-state entries of this rank (the engine refreshes them)."""
        self.placement = header.placement
        """The expert placement the plan writes (checked against the engine's per update)."""
        self.plan: executor.Executor | None = None
        self.shadow: executor.Shadow | None = None
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

    def written(self) -> list[str]:
        """The names of the tensors the plan writes on this rank (its regions)."""
        return [r.name for r in self.part.regions if r.name != STAGING]

    def load(self, tensors: dict[str, torch.Tensor], *, shadow: dict[str, torch.Tensor] | None
             = None, transport: str = "nixl", rendezvous: object = None,
             timeout_s: float = 60.0) -> executor.Executor:
        """Bind `tensors` (or, given `shadow`, an `executor.Shadow` of those live tensors),
        register once and connect to the peers."""
        if shadow is not None:
            self.shadow = executor.Shadow(shadow)
            tensors = self.shadow.tensors
        opts = LoadOptions(transport=transport, rendezvous=rendezvous, timeout_s=timeout_s,
                           plan_key=self.plan_key, identity=self.identity)
        self.plan = executor.Executor.load_part(self.header, self.part, tensors, opts,
                                                self.path)
        if self.shadow is not None:
            self.shadow.attach(self.plan)
        return self.plan

    def begin(self, version: str | None = None) -> None:
        """A new update: nothing received, nothing torn."""
        self.pending, self.failure, self.received, self.torn_open = version, None, False, False
        self.landed = None

    def run_step(self) -> bool:
        """Paused mode: this rank's step into the live tensors; whether it completed (else
        the error is `failure`)."""
        assert self.plan is not None, "load() first"
        try:
            executor.run(self.plan)
        except Exception as e:  # noqa: BLE001 - kept: the engine agrees and reports it
            self.failure = e
        return self.failure is None and self.plan.complete

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

    def commit(self, version: str | None) -> None:
        """Every byte landed and the engine refreshed and checked: `version` is committed."""
        self.version, self.received = version, False

    def close(self) -> None:
        if self.shadow is not None:
            self.shadow.join()  # its thread uses the executor
            self.shadow = None
        if self.plan is not None:
            self.plan.close()
            self.plan = None
