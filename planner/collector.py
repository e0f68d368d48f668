"""Python's cyclic garbage collector paused around work that makes millions of small
objects, none in a cycle: a compile's layouts and columns, a tool's per-rank lists, a
decoded trace or an import. Each is freed by its reference count; the collector's passes
would walk every live one again and again and find nothing to free. And `release_free`:
the heap's free pages given back to the system between a compile's passes."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off inside (if it was on), back on after, as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def release_free() -> None:
    """Give the free pages inside the C heap back to the system (glibc's `malloc_trim`;
    elsewhere nothing). The arrays below the mmap threshold (`cli._map_large_arrays`) and
    Python's small objects live on the heap: once a pass drops them, its holes stay
    resident (glibc returns only the heap's top) and count in the peak of the passes
    after it. A few milliseconds a call."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None
"""glibc's `malloc_trim` once looked up; False where there is none."""
