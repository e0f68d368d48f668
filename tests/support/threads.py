"""Callables run at once, each on its own thread, the first error re-raised: the ranks of a
plan in one process, whose loads wait for each other's records and whose steps wait for
each other's writes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


def together(fns: Iterable[Callable[[], object]], timeout_s: float = 300.0) -> list[object]:
    """Run every `fn` at once; their results in order, or the first error raised."""
    fns = list(fns)
    out: list[object] = [None] * len(fns)
    errors: list[BaseException] = []

    def guarded(i: int, fn: Callable[[], object]) -> None:
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    ts = [threading.Thread(target=guarded, args=(i, fn), daemon=True)
          for i, fn in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in ts):
        raise AssertionError(f"still running after {timeout_s} s")
    return out
