"""How the host waits: spin first, then nap.

A signal or a landed copy usually comes within microseconds on NVLink and shared memory;
a `time.sleep` costs 50-100 us of the kernel's timer slack, more than a whole 1 MiB write
takes. So a wait polls without sleeping for its first `SPIN_S`, then naps from 20 us up to
200 us (never a busy loop for long: a wait for a slow peer costs no core). The time a step
spends in waits is counted (`waited`), so a benchmark can tell host work from waiting.
"""

from __future__ import annotations

import time

SPIN_S = 2e-4
"""Seconds a wait polls without sleeping."""
NAP_MAX_S = 2e-4


class Backoff:
    """`pause()` between two polls of one wait: nothing during the spin, then naps."""

    __slots__ = ("spin_until", "nap")

    def __init__(self, spin_s: float = SPIN_S) -> None:
        self.spin_until = time.perf_counter() + spin_s
        self.nap = 2e-5

    def pause(self) -> None:
        if time.perf_counter() < self.spin_until:
            return
        time.sleep(self.nap)
        self.nap = min(self.nap * 2, NAP_MAX_S)
