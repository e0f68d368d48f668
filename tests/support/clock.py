"""Time in tests: a guard against a hang, never a measure of speed.

The suite runs on shared, often loaded boxes, so no test asserts on wall time. Two tools
take its place:

- `guard_s(quiet_s)`: how long to wait for an answer before calling it a hang: at least
  `FACTOR` (10) times what the wait takes on a quiet box (times `RDMA_PLAN_TEST_SLOW`, a
  factor a developer may set on a very slow box). `no_answer` words the failure so that a
  reader tells a hang from a slow box: "no answer in N s (box load L)".
- `cpu_seconds()`: the CPU seconds this process (or its finished children) spent, for
  bounded-work checks ("a hostile config is refused cheaply"): a process's CPU time does not
  grow when other processes share its cores.
"""

from __future__ import annotations

import os
import resource
import time

FACTOR = 10.0
"""A hang guard is at least this many times the wait on a quiet box."""


def box_load() -> float:
    """The 1-minute load average (what `no_answer` reports beside a timeout)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def guard_s(quiet_s: float) -> float:
    """Seconds to wait for something that takes `quiet_s` on a quiet box before calling it a
    hang: `FACTOR` times that, times `RDMA_PLAN_TEST_SLOW` (default 1)."""
    slow = float(os.environ.get("RDMA_PLAN_TEST_SLOW", "1") or 1)
    return FACTOR * quiet_s * max(1.0, slow)


def no_answer(what: str, seconds: float) -> str:
    """The one line a hang guard fails with: what gave no answer, in how long, at what load."""
    return f"{what}: no answer in {seconds:.0f} s (box load {box_load():.1f})"


def cpu_seconds(children: bool = False) -> float:
    """User + system CPU seconds of this process (all its threads), or of its children that
    have been waited for."""
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def wait_until(cond, quiet_s: float, what: str, poll_s: float = 0.01) -> None:
    """Poll `cond()` until it is true; fail with `no_answer` after `guard_s(quiet_s)`."""
    import pytest

    limit = guard_s(quiet_s)
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            pytest.fail(no_answer(what, limit))
        time.sleep(poll_s)


def within_guard(waited: float, quiet_s: float, what: str) -> None:
    """Fail with `no_answer` if `waited` seconds passed `guard_s(quiet_s)`: a hang guard on
    something already awaited (a timeout that must fire, a process that must stop)."""
    import pytest

    if waited >= guard_s(quiet_s):
        pytest.fail(no_answer(what, waited))
