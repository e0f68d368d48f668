"""Zero-pause refit: the plan writes version N+1 into a shadow while the engine serves N.

    shadow = Shadow(live)                      # {name: tensor}: the engine's weights
    shadow.attach(executor.load(path, rank, shadow.tensors, ...))  # or Shadow.load(...)
    shadow.start()                             # returns at once; the engine keeps generating
    ...                                        # decode steps read `live` (version N)
    shadow.finish(timeout_s)                   # the last DONE: raises TornUpdateError if not
    pause_s = shadow.switch()                  # between two engine steps: shadow -> live

**Memory.** A full shadow costs the target's weight bytes once more (`extra_bytes`,
`schemas.shadow.shadow_bytes(rank_plan)` for `rdma-plan inspect`). The shadow is allocated once (a
copy of `live`, so bytes the plan does not write keep their value) and registered once: the
executor binds it, never `live`.

**Switch.** Local copies into the live tensors: every live `data_ptr` stays, so CUDA
graphs captured on the weights stay valid and nothing the engine derived from the addresses
(prepacked handles, views) moves. A plan compiled with `target.shadow: full` carries the
switch as ops (`schemas/shadow.py`, checked at load): `switch` copies exactly the bytes the
plan writes, chunk (layer) by chunk, and leaves bytes no op writes (padding) as the engine
holds them (`ShadowStats.switched_bytes`); a plan without the section is switched tensor
by tensor. On a GPU each chunk's copies are one kernel launch (`executor/switch.py`: the
launches of one `copy_` per tensor cost several times the copy). Pointer swaps would be
cheaper but break every captured graph; a GPU copies its own memory far faster than any
link delivers it, so the copy is a small fraction of any transfer. The pause is what the
copy costs (`ShadowStats.pause_s`).

**Chunked shadow** (`target.shadow: {budget_bytes: N}`): runs in `executor/chunked.py`
(`ChunkedShadow`), from the chunk plans `rdma-plan compile` writes for it. A chunk plan
carrying a chunked section writes its tensors as views of one buffer, which only
`ChunkedShadow` binds, so `attach` refuses it here (one line). Its mixed-version
window: while chunks are switched one by one, layers already switched serve N+1 and the
rest N, so an engine must pause across the whole chunked refit unless the caller accepts
that mix.

**Why a thread is safe.** `start()` runs the executor's ordinary `run()` on one background
thread. The writes are one-sided: peers write the shadow's registered memory, the engine's
thread does no work for them. The `Executor` object is touched by that thread only, from
`start()` until `finish()` joins it (this class refuses `start`/`switch` in between), and the
thread writes only the shadow, which the engine never reads. On a GPU its copies and syncs
run on a stream of its own (unless the transport queues every rank on one stream), so it
waits for its own work, not for the engine's decode kernels.

**Torn updates.** A source that dies or never sends DONE: the thread's `run()` raises (the
executor's timeout) or has not returned by `finish(timeout_s)`; `finish` raises
`TornUpdateError`, the live tensors are untouched and the version is not committed. The next
`start()` waits for a straggling thread (bounded by the executor's timeout), and the
executor recovers from the failed step as after any failure; the shadow is fully rewritten
by the next complete step before it can be switched.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from schemas.plan import RankPlan

from .core import Executor
from .errors import TornUpdateError
from .options import LoadOptions
from .stats import RunStats, ShadowStats
from .switch import SwitchCopies


class Shadow:
    """A full shadow of a target rank's `live` tensors, written by a plan's executor."""

    def __init__(self, live: dict[str, torch.Tensor]) -> None:
        bad = [n for n, t in live.items() if not isinstance(t, torch.Tensor)]
        if bad:
            raise TypeError(f"Shadow: live[{bad[0]!r}] is {type(live[bad[0]]).__name__}, not a "
                            "tensor; pass the engine's weights as {name: tensor}")
        self.live = live
        with torch.no_grad():
            self.tensors = {n: t.detach().clone() for n, t in live.items()}
        """The shadow: what the executor binds and registers (once)."""
        self.extra_bytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.executor: Executor | None = None
        self.version = 0
        """Switched (committed) updates."""
        self.last: ShadowStats | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stats: RunStats | None = None
        self._t0 = self._t1 = 0.0
        self._ready = False  # a complete step waits in the shadow for `switch`
        self._abandoned = False  # finish() gave up on the running thread
        self._stream: Any = None
        self.ops: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        """The plan's switch as (live bytes, shadow bytes) views per chunk; None: whole
        tensors (a plan compiled without `target.shadow`)."""
        self.copies: SwitchCopies | None = None
        """The switch's copies (one launch per chunk on a GPU: `executor/switch.py`)."""

    @classmethod
    def load(cls, path: str, rank: int, live: dict[str, torch.Tensor],
             options: LoadOptions | None = None, **fields: Any) -> Shadow:
        """`executor.load(path, rank, <the shadow>, options, **fields)` around a new
        shadow."""
        shadow = cls(live)
        shadow.attach(Executor.load(path, rank, shadow.tensors, options, **fields))
        return shadow

    def attach(self, ex: Executor) -> None:
        """Use `ex`, loaded on `self.tensors` (not on `live`), for every update. A plan
        compiled with `target.shadow: full` drives the switch by its ops (`switch_ops`)."""
        live = {t.data_ptr() for t in self.live.values()}
        if any(r.data_ptr() in live for r in ex.regions):
            raise ValueError(f"Shadow: rank {ex.rank}'s executor is not bound to the shadow "
                             "tensors; load it on `shadow.tensors` (or use Shadow.load)")
        self.ops = switch_ops(ex.plan, self.live, self.tensors)
        whole = [[(t, self.tensors[n]) for n, t in self.live.items()]]
        self.copies = SwitchCopies(whole if self.ops is None else self.ops)
        self.executor = ex
        if ex.device.type == "cuda" and not ex.one_stream:
            self._stream = torch.cuda.Stream(ex.device)
            self._stream.wait_stream(torch.cuda.current_stream(ex.device))  # the clones

    @property
    def running(self) -> bool:
        """An update was started and `finish` has not ended it yet."""
        return self._thread is not None and not self._abandoned

    def start(self, step: int | None = None) -> None:
        """Begin this rank's part of the next step on a background thread; returns at once."""
        if self.executor is None:
            raise RuntimeError("Shadow: attach an executor (or use Shadow.load) before start()")
        if self._thread is not None and not self._abandoned:
            raise RuntimeError("Shadow: start() while the previous update runs; call "
                               "finish() first")
        self.join()  # a torn update's thread: its executor's timeout ends it
        if self._ready:
            raise RuntimeError("Shadow: a complete update waits for switch(); switch it (or "
                               "call discard()) before starting the next one")
        self._error, self._stats = None, None
        self._t0 = self._t1 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(step,), daemon=True,
                                        name=f"rdma-plan shadow rank {self.executor.rank}")
        self._thread.start()

    def _run(self, step: int | None) -> None:
        ex = self.executor
        assert ex is not None
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._stats = ex.run(step)
            else:
                self._stats = ex.run(step)
        except BaseException as e:  # noqa: BLE001 - handed to finish() on the caller's thread
            self._error = e
        self._t1 = time.perf_counter()

    def finish(self, timeout_s: float | None = None) -> RunStats:
        """Wait (at most `timeout_s`; None: the executor's own timeout bounds it) for the
        step's last DONE. Raises `TornUpdateError` if it did not complete."""
        if self._thread is None or self._abandoned:
            raise RuntimeError("Shadow: finish() without start()")
        self._thread.join(timeout_s)
        ex = self.executor
        assert ex is not None
        rank = ex.rank
        if self._thread.is_alive():  # still waiting for a peer: the next start() joins it
            self._abandoned = True
            raise TornUpdateError(
                f"Shadow: rank {rank}: the update did not complete within {timeout_s:g} s (a "
                "source is slow or gone); the live weights keep version "
                f"{self.version} and nothing was committed; start() again once the peer is "
                "back")
        self._thread = None
        if self._error is not None or self._stats is None or not self._stats.complete:
            raise TornUpdateError(
                f"Shadow: rank {rank}: the update did not complete: {self._error!r}; the live "
                f"weights keep version {self.version} and nothing was committed; start() "
                "again once the peer is back") from self._error
        self._ready = True
        return self._stats

    def discard(self) -> None:
        """Drop a complete update without switching it (the live weights stay)."""
        self._ready = False

    def switch(self) -> float:
        """Copy the shadow into the live tensors in place (their `data_ptr`s stay); commit
        the version; the seconds it took (the engine's pause for the switch)."""
        if self._thread is not None or not self._ready:
            raise RuntimeError("Shadow: switch() needs a complete update: start(), then a "
                               "finish() that returned")
        assert self.copies is not None
        t0 = time.perf_counter()
        for k in range(len(self.copies.chunks)):  # whole tensors, or the plan's chunks
            self.copies.copy(k)
        self.copies.sync()
        pause = time.perf_counter() - t0
        self._ready = False
        self.version += 1
        assert self._stats is not None
        self.last = ShadowStats(self._stats.step, self.version, self._t1 - self._t0, pause,
                                self.extra_bytes, self._stats, self.switched_bytes)
        return pause

    @property
    def switched_bytes(self) -> int:
        """Bytes one switch copies: what the plan writes (with its switch ops), else every
        live byte."""
        if self.ops is None:
            return self.extra_bytes
        return sum(d.numel() for chunk in self.ops for d, _ in chunk)

    def join(self) -> None:
        """Wait for a straggling thread of a torn update (bounded by the executor's
        timeout); `start()` calls it first."""
        if self._thread is not None:
            self._thread.join()
            self._thread, self._abandoned = None, False

    def close(self) -> None:
        self.join()
        if self.executor is not None:
            self.executor.close()
            self.executor = None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def switch_ops(plan: RankPlan, live: dict[str, torch.Tensor], shadow: dict[str, torch.Tensor]
               ) -> list[list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """The switch ops of `plan`'s shadow section (`schemas/shadow.py`, checked at load) as
    (live bytes, shadow bytes) views, one list per chunk; None without a section. A chunked
    section is refused: see the module docstring."""
    sh = plan.shadow
    if sh is None:
        return None
    if sh.budget:
        raise ValueError(
            f"Shadow: rank {plan.rank}'s plan carries a chunked shadow ({sh.budget:,} bytes, "
            f"{sh.chunks} chunks) whose writes address the tensors; a chunked refit runs "
            "from the chunk plans `rdma-plan compile` writes for it, with "
            "executor.ChunkedShadow (docs/architecture.md, 'Chunked shadow'); compile with "
            "`target.shadow: full` for `Shadow`")
    names = [r.name for r in plan.regions]
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(sh.chunks)]
    s = sh.switch
    for c, r, o, n in zip(s["chunk"].tolist(), s["region"].tolist(), s["offset"].tolist(),
                          s["nbytes"].tolist()):
        name = names[r]
        if name not in live or not live[name].is_contiguous() \
                or not shadow[name].is_contiguous():
            raise ValueError(f"Shadow: rank {plan.rank}: the plan switches {name!r}, which is "
                             "not a contiguous tensor of `live`; pass the engine's bound "
                             "tensors as {name: tensor}")
        out[c].append((_bytes(live[name])[o:o + n], _bytes(shadow[name])[o:o + n]))
    return out
