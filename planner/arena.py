"""Fresh arrays cut from a few large allocations (`Arena`).

A replan makes many arrays of one source rank's size (its writes, some hundred KB each) and
keeps them: the new plan's columns and the indexes kept for the next replan. Allocated one
by one, each is fresh memory, faulted in page by page on its first write; cut from
allocations of several MB, they are backed by huge pages where the kernel gives them
(numpy asks for them on large allocations), and fault in a few times.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Arena:
    """Hands out fresh 1-d arrays as slices of larger ones, one run per dtype. A slice
    keeps its whole allocation alive: for arrays that live as long as one another."""

    CHUNK = 8 << 20
    """Bytes of each allocation (arrays of half that or more get their own)."""

    def __init__(self) -> None:
        self._runs: dict[str, tuple[np.ndarray, int]] = {}

    def empty(self, n: int, dtype: Any) -> np.ndarray:
        """An uninitialised array of `n` elements of `dtype`."""
        dt = np.dtype(dtype)
        if n * dt.itemsize >= self.CHUNK // 2:
            return np.empty(n, dt)
        buf, used = self._runs.get(dt.str, (None, 0))
        if buf is None or used + n > len(buf):
            buf, used = np.empty(self.CHUNK // dt.itemsize, dt), 0
        self._runs[dt.str] = (buf, used + n)
        return buf[used:used + n]

    def copy(self, a: np.ndarray, dtype: Any = None) -> np.ndarray:
        """A copy of the 1-d array `a` (as `dtype`)."""
        out = self.empty(len(a), a.dtype if dtype is None else dtype)
        out[...] = a
        return out

    def take(self, a: np.ndarray, at: np.ndarray) -> np.ndarray:
        """`a[at]` (`at`: valid positions)."""
        return np.take(a, at, out=self.empty(len(at), a.dtype))
