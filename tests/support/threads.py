"""Callables run at once, each on its own thread, the first error re-raised: the ranks of a
plan in one process, whose loads wait for each other's records and whose steps wait for
each other's writes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import executor


def together(fns: Iterable[Callable[[], object]], timeout_s: float = 300.0,
             errors: list[BaseException] | None = None) -> list[object]:
    """Run every `fn` at once; their results in order, or the first error raised. Given
    `errors`, every error is appended there in the order raised and none is re-raised."""
    fns = list(fns)
    out: list[object] = [None] * len(fns)
    caught: list[BaseException] = [] if errors is None else errors

    def guarded(i: int, fn: Callable[[], object]) -> None:
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            caught.append(e)
    ts = [threading.Thread(target=guarded, args=(i, fn), daemon=True)
          for i, fn in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout_s)
    if caught and errors is None:
        raise caught[0]
    if any(t.is_alive() for t in ts):
        raise AssertionError(f"still running after {timeout_s} s")
    return out


def lockstep(exs: list[executor.Executor], steps: int,
             before_step: Callable[[executor.Executor, int], None] | None = None,
             errors: list[BaseException] | None = None, timeout_s: float = 120.0) -> None:
    """Every executor of a plan on its own thread (`together`): register, connect, then
    `steps` steps, every rank passing one barrier before and one after each step
    (`before_step(ex, step)` first: the training step's new weights). A rank that raises
    breaks the barrier for the others; `errors` as in `together`."""
    gate = threading.Barrier(len(exs))

    def rank(ex: executor.Executor) -> None:
        try:
            ex.register()
            gate.wait()
            ex.connect()
            for step in range(steps):
                if before_step is not None:
                    before_step(ex, step)
                gate.wait()
                executor.run(ex)
                gate.wait()
        except BaseException:
            gate.abort()
            raise
    together([lambda ex=ex: rank(ex) for ex in exs], timeout_s, errors)
