"""How the host waits: spin first, then nap, each nap a small share of the wait so far.

A signal or a landed copy usually comes within microseconds on NVLink and shared memory;
a `time.sleep` costs 50-100 us of the kernel's default timer slack, more than a whole
1 MiB write takes. So a wait polls without sleeping for its first `SPIN_S`, then naps
`NAP_SHARE` of the time it has waited so far (between `NAP_MIN_S` and `NAP_MAX_S`): a wait
that ends after 4 ms is noticed at most ~60 us late, one for a slow peer costs no core.
The first nap of a thread sets its timer slack to 1 us (Linux `prctl`), so a nap lasts
what it asks for (with the default slack a nap overshoots by tens of microseconds: the
source notices its landed copies late, the target the DONE). The time a step spends
in waits is counted (`waited`), so a benchmark can tell host work from waiting.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

SPIN_S = float(os.environ.get("RDMA_PLAN_SPIN_S", "2e-3"))
"""Seconds a wait polls without sleeping (`RDMA_PLAN_SPIN_S` sets it for a process). A
nap, however short, is noticed tens of microseconds late on the GPU hosts (the core sleeps
deeper than the timer asks), a visible share of a sub-millisecond step. Waits of whole
weight updates last seconds: 2 ms of spinning each is nothing to them."""
NAP_MIN_S = 1e-5
NAP_MAX_S = 2e-4
NAP_SHARE = 1 / 64
"""A nap is this share of the time waited so far (clamped to the two bounds above)."""
_PR_SET_TIMERSLACK = 29
_slack = threading.local()


def tight_timer_slack() -> bool:
    """Set this thread's timer slack to 1 us, once (False where the OS has no `prctl`)."""
    if not hasattr(_slack, "set"):
        try:
            _slack.set = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000,
                                                                0, 0, 0) == 0
        except (OSError, AttributeError):
            _slack.set = False
    return _slack.set


class Backoff:
    """`pause()` between two polls of one wait: nothing during the spin, then naps."""

    __slots__ = ("t0", "spin_until")

    def __init__(self, spin_s: float = SPIN_S) -> None:
        self.t0 = time.perf_counter()
        self.spin_until = self.t0 + spin_s

    def pause(self) -> None:
        now = time.perf_counter()
        if now < self.spin_until:
            return
        tight_timer_slack()
        time.sleep(min(NAP_MAX_S, max(NAP_MIN_S, (now - self.t0) * NAP_SHARE)))
