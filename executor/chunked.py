"""A chunked shadow: the refit streams through one buffer of N bytes, chunk by chunk.

    target:  shadow = ChunkedShadow.load(path, rank, live, transport=..., rendezvous=...)
             stats = shadow.run(step)        # chunk k: transfer into the buffer, switch
    source:  chunks = load_chunks(path, rank, tensors, transport=..., rendezvous=...)
             run_chunks(chunks, step)

The plan file (`schemas/chunked_plan.py`, compiled with `target.shadow: {budget_bytes: N}`
by `planner/passes/chunked.py`) holds one ordinary plan per chunk: a chunk is a set of whole
target tensors, layer by layer, that fit N bytes. Each rank loads one `Executor` per chunk
(own rendezvous namespace: `chunk_rendezvous`). On a target, chunk k's executor binds the
chunk's tensors as views of ONE buffer of N bytes, at the offsets the plan's switch ops
state (`schemas.chunked_plan.bases`): whatever the chunk's writes and UNPACKs land, they land there.
`run(step)` then, for k = 0, 1, ...: runs chunk k's step (its last DONE), and switches it:
local copies of the written bytes from the buffer into the live tensors (every live
`data_ptr` stays, as with the full shadow).

**Order.** A source writes into a target only after that target's READY of the step
(`schemas/protocol.py`), and the target sends chunk k+1's READY when it starts chunk k+1's
step, which `run` does only after chunk k's switch returned: so no source overwrites the
buffer before the target switched the chunk it holds. Sources may run ahead (they block in
chunk k+1 on READY): tests/executor/test_chunked.py checks both.

**Mixed-version window.** While `run` goes chunk by chunk, the tensors of chunks already
switched hold version N+1 and the others N. An engine reading them between two switches
serves a MIX of versions: keep it paused across the whole `run(step)` (the pause is then
the whole chunked refit, transfer included), unless the caller accepts that mix (then
each chunk's switch is a pause of its own: `ChunkedStats.switch_s`). `before_switch(k)`
is called before chunk k's switch (the engine may wait for a step boundary there).

**Torn chunk.** A source that never sends chunk k: chunk k's step fails (the executor's
timeout), `run` raises `TornUpdateError`, and stops: chunks 0..k-1 were switched (version
N+1), chunk k and after keep version N in the live tensors (chunk k's bytes in the buffer
are never copied); `switched` says how many, the version is not committed, and the next
`run` starts again at chunk 0 (every chunk rewritten). The engine must stay paused (it
holds a mix) until a complete `run`. A chunk that fails gives the step up in every other
chunk of its rank (`give_up`: the later ones ABORT it to their peers at once, instead of
those waiting out their timeouts, and all are marked failed), and every chunk of a refit
runs the step number chunk 0 runs (its recovery joins the step the peers run): a late
writer tears the refits it misses and the next one completes, on every rank.

**Memory.** `extra_bytes`: the buffer, N bytes (`rdma-plan inspect` shows it per rank),
plus each chunk plan's own staging where it has one (as any plan's).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from schemas.chunked_plan import bases, check_chunk_rank, load_rank_chunks
from schemas.header import PlanHeader
from schemas.integrity import plan_key as read_key
from schemas.plan import STAGING, RankPlan

from .bind import bind, torch_dtype
from .cleanup import best_effort
from .core import Executor
from .errors import TornUpdateError
from .options import LoadOptions
from .stats import RunStats
from .switch import SwitchCopies
from .trust import check_identity

__all__ = ["ChunkedShadow", "ChunkedStats", "chunk_rendezvous", "load_chunks", "run_chunks"]

_CHILDREN: dict[int, Any] = {}  # 'host:port' -> this process's one client of it
_LOCK = threading.Lock()


def chunk_rendezvous(rendezvous: object, k: int, rank: int = 0, timeout_s: float = 60.0
                     ) -> object:
    """Chunk k's own rendezvous: a child of a local `Fabric` (the same for every rank of
    the process), or a torch Store (or 'host:port', opened once) under the prefix
    `rplan-chunk<k>/`: each chunk's executors meet their peers' of the same chunk only."""
    from .transports.local import FABRIC, Fabric
    rendezvous = FABRIC if rendezvous is None else rendezvous
    if isinstance(rendezvous, Fabric):
        return rendezvous.child(k)  # kept on the parent: they live and go with it
    import torch.distributed as dist
    if isinstance(rendezvous, str):
        from .rendezvous import tcp_store
        host, _, port = rendezvous.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"rendezvous {rendezvous!r} is not 'host:port'")
        with _LOCK:
            key = hash((rendezvous, rank))
            if key not in _CHILDREN:
                _CHILDREN[key] = tcp_store(dist, host, int(port), rank, timeout_s)
            rendezvous = _CHILDREN[key]
    if not isinstance(rendezvous, dist.Store):
        raise ValueError(f"a chunked shadow needs rendezvous as a local Fabric, a torch Store "
                         f"or 'host:port', not {type(rendezvous).__name__}")
    return dist.PrefixStore(f"rplan-chunk{k}/", rendezvous)


def _parts(path: str, rank: int, o: LoadOptions
           ) -> tuple[int, list[tuple[PlanHeader, RankPlan]]]:
    """The budget and rank `rank`'s part of every chunk, all read and checked before any
    executor is made (a broken chunk k is refused before chunk 0 connects)."""
    return load_rank_chunks(path, rank, None if o.plan_key is None else read_key(o.plan_key))


def check_identities(parts: list[tuple[PlanHeader, RankPlan]], o: LoadOptions, path: str
                     ) -> None:
    """Each chunk's part against `o.identity` (`trust.check_identity`), before any binds."""
    for k, (header, rp) in enumerate(parts):
        check_identity(header, rp.identity, rp.rank, o.identity, o.no_identity,
                       f"{path} chunk {k}")


def chunk_options(o: LoadOptions, k: int, rank: int) -> LoadOptions:
    """`o` for chunk k's executor: its rendezvous namespace (`chunk_rendezvous`)."""
    return dataclasses.replace(o, rendezvous=chunk_rendezvous(o.rendezvous, k, rank,
                                                              o.timeout_s))


def load_chunks(path: str, rank: int, tensors: dict[str, torch.Tensor],
                options: LoadOptions | None = None, **fields: Any) -> list[Executor]:
    """A source rank's executors of a chunked plan, one per chunk, each bound to `tensors`,
    registered and connected (every rank loads the chunks in the same order)."""
    o = LoadOptions.of(options, fields)
    _, parts = _parts(path, rank, o)
    check_identities(parts, o, path)
    out: list[Executor] = []
    for k, (header, rp) in enumerate(parts):
        ex = Executor(header, rp, tensors, chunk_options(o, k, rank))
        ex.register()
        ex.connect()
        out.append(ex)
    return out


def run_chunks(chunks: list[Executor], step: int | None = None) -> list[RunStats]:
    """A source's step of a chunked plan: chunk 0, 1, ... in order (each waits for its
    targets' READY, sent only once they switched the chunk before), every chunk under one
    step number: `step`, else the one chunk 0 runs (after a failed refit its recovery joins
    the peers' step). A chunk that fails gives the step up in the others (`give_up`)."""
    out = []
    for k, ex in enumerate(chunks):
        try:
            out.append(ex.run(step))
        except Exception as e:
            give_up(chunks, k, ex.step, getattr(e, "peer", None))
            raise
        step = ex.step
    return out


def give_up(chunks: list[Executor], k: int, step: int, lost: int | None) -> None:
    """After chunk k failed step `step`: the chunks after it give the step up at once,
    telling their peers (ABORT: they stop waiting for this rank there now, not at their
    timeout), and every chunk is marked failed, so the next refit's chunk 0 recovers to
    the step its peers run (a late rank catches up instead of staying a step behind)."""
    for j, ex in enumerate(chunks):
        def fail(ex: Executor = ex, later: bool = j > k) -> None:
            if later:
                ex.begin_step(step)
                ex.fail(ex.rank if lost is None else lost)
            elif not ex.failed:
                ex.fail()
        best_effort(f"rank {ex.rank}: giving up step {step} in chunk {j}", fail)


@dataclass
class ChunkedStats:
    """One chunked refit on a target rank (`ChunkedShadow.run`)."""

    step: int
    version: int
    """Complete refits switched so far, this one included."""
    transfer_s: list[float] = field(default_factory=list)
    """Per chunk: its step, READY to its last DONE (and unpacks)."""
    switch_s: list[float] = field(default_factory=list)
    """Per chunk: its switch (the pause it costs an engine serving the mix)."""
    switched_bytes: list[int] = field(default_factory=list)
    extra_bytes: int = 0
    """The buffer: N bytes."""


class ChunkedShadow:
    """A target rank's chunked shadow: one buffer of `budget` bytes, one executor per chunk."""

    def __init__(self, live: dict[str, torch.Tensor], budget: int) -> None:
        bad = [n for n, t in live.items() if not isinstance(t, torch.Tensor)]
        if bad:
            raise TypeError(f"ChunkedShadow: live[{bad[0]!r}] is {type(live[bad[0]]).__name__}"
                            ", not a tensor; pass the engine's weights as {name: tensor}")
        self.live, self.budget = live, budget
        device = next(iter(live.values())).device if live else torch.device("cpu")
        self.buffer = torch.zeros(budget, dtype=torch.uint8, device=device)
        """The N bytes every chunk lands in, in turn."""
        self.extra_bytes = budget
        self.chunks: list[Executor] = []
        self.ops: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        """Per chunk: its switch as (live bytes, buffer bytes) views."""
        self.copies: SwitchCopies | None = None
        self.version = 0
        self.switched = 0
        """Chunks of the current (or last) refit switched into the live tensors."""
        self.last: ChunkedStats | None = None

    @classmethod
    def load(cls, path: str, rank: int, live: dict[str, torch.Tensor],
             options: LoadOptions | None = None, **fields: Any) -> ChunkedShadow:
        """Load every chunk of rank `rank` (register, connect: all ranks in the same order)."""
        o = LoadOptions.of(options, fields)
        budget, parts = _parts(path, rank, o)
        return cls.load_parts(budget, parts, live, o, path)

    @classmethod
    def load_parts(cls, budget: int, parts: list[tuple[PlanHeader, RankPlan]],
                   live: dict[str, torch.Tensor], options: LoadOptions, path: str = "plan"
                   ) -> ChunkedShadow:
        """`load` of the parts its caller has read (`schemas.chunked_plan.read_rank_chunks`:
        the engine core reads the plan file once): identities, every chunk's tensors
        against `live`, then each chunk's executor registered and connected in order."""
        check_identities(parts, options, path)
        self = cls(live, budget)
        for _, rp in parts:  # every chunk's tensors against `live`, before any connects
            self.bind_live(rp)
        for k, (header, rp) in enumerate(parts):
            ex = Executor(header, rp, self.views(rp), chunk_options(options, k, rp.rank))
            ex.register()
            ex.connect()
            self.attach(ex)
        return self

    def views(self, rp: RankPlan) -> dict[str, torch.Tensor]:
        """Chunk `rp`'s tensors as views of the buffer at the plan's bases: what its
        executor binds."""
        check_chunk_rank(rp, self.budget, f"rank {rp.rank}'s chunk plan")
        return {g.name: self.buffer[b:b + g.nbytes].view(torch_dtype(g.dtype)).view(g.shape)
                for b, g in zip(bases(rp), rp.regions) if g.name != STAGING}

    def bind_live(self, rp: RankPlan) -> None:
        """Raise `BindError` unless `live` holds every tensor of chunk `rp` as the plan
        states it (name, shape, dtype, contiguity, bytes): the check `load` makes of the
        tensors it binds, here of the tensors the switch writes."""
        bind(rp.rank, tuple(g for g in rp.regions if g.name != STAGING), self.live)

    def attach(self, ex: Executor) -> None:
        """Add the next chunk's executor (bound to `views(ex.plan)`)."""
        plan = ex.plan
        self.bind_live(plan)
        sh = plan.shadow
        if sh is None or sh.budget != self.budget:
            raise ValueError(f"ChunkedShadow: rank {plan.rank}'s chunk plan is not a chunked "
                             f"shadow of {self.budget} bytes; compile with target.shadow: "
                             f"{{budget_bytes: {self.budget}}}")
        base = self.buffer.data_ptr()
        if any(not base <= r.data_ptr() < base + self.budget for r, g in
               zip(ex.regions, plan.regions) if g.name != STAGING):
            raise ValueError(f"ChunkedShadow: rank {plan.rank}: chunk {len(self.chunks)}'s "
                             "executor is not bound to the buffer; use ChunkedShadow.load")
        names = [g.name for g in plan.regions]
        ops = []
        s = sh.switch
        for r, o, n, so in zip(s["region"].tolist(), s["offset"].tolist(),
                               s["nbytes"].tolist(), s["shadow_offset"].tolist()):
            t = self.live.get(names[r])
            if t is None or not t.is_contiguous() or t.numel() * t.element_size() < o + n:
                raise ValueError(f"ChunkedShadow: rank {plan.rank}: the plan switches "
                                 f"{names[r]!r}, which is not a contiguous tensor of `live` "
                                 "of its size; pass the engine's bound tensors")
            ops.append((t.detach().reshape(-1).view(torch.uint8)[o:o + n],
                        self.buffer[so:so + n]))
        self.chunks.append(ex)
        self.ops.append(ops)
        self.copies = None  # built at the first run, over every chunk's ops

    def run(self, step: int | None = None,
            before_switch: Callable[[int], None] | None = None) -> ChunkedStats:
        """One chunked refit: per chunk, its transfer into the buffer then its switch. The
        live tensors hold a MIX of versions until it returns (module docstring); raises
        `TornUpdateError` when a chunk does not complete (`switched` chunks were)."""
        if not self.chunks:
            raise RuntimeError("ChunkedShadow: no chunk loaded (use ChunkedShadow.load)")
        st = ChunkedStats(-1 if step is None else step, self.version,
                          extra_bytes=self.extra_bytes)
        self.switched = 0
        if self.copies is None:  # one launch per chunk on a GPU (executor/switch.py)
            self.copies = SwitchCopies(self.ops)
        for k, ex in enumerate(self.chunks):
            t0 = time.perf_counter()
            try:
                stats = ex.run(step)
                if not stats.complete:
                    raise RuntimeError("the step did not complete")
                step = st.step = ex.step  # chunk 0 chose it where none was given
            except Exception as e:  # noqa: BLE001 - raised as the torn refit it is
                give_up(self.chunks, k, ex.step, getattr(e, "peer", None))
                self.last = st
                done = (f"chunks 0..{k - 1} were switched (version N+1), chunk {k} and after "
                        "keep version N: the live tensors hold a mix" if k else
                        "no chunk was switched: the live tensors keep version N")
                raise TornUpdateError(
                    f"ChunkedShadow: rank {ex.rank}: chunk {k} of {len(self.chunks)} did not "
                    f"complete ({e}); {done}; version {self.version} stays committed; keep "
                    "the engine paused and run() again (it starts at chunk 0)") from e
            t1 = time.perf_counter()
            if before_switch is not None:
                before_switch(k)
            t2 = time.perf_counter()
            self.copies.copy(k)
            self.copies.sync()
            st.transfer_s.append(t1 - t0)
            st.switch_s.append(time.perf_counter() - t2)
            st.switched_bytes.append(sum(d.numel() for d, _ in self.ops[k]))
            self.switched = k + 1
        self.version += 1
        st.version = self.version
        self.last = st
        return st

    def close(self) -> None:
        for ex in self.chunks:
            ex.close()
        self.chunks = []
