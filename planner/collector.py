"""Python's cyclic garbage collector paused around work that makes millions of small
objects, none in a cycle: a compile's layouts and columns, a tool's per-rank lists, a
decoded trace or an import. Each is freed by its reference count; the collector's passes
would walk every live one again and again and find nothing to free. And glibc's heap:
`release_free` gives its free pages back to the system between a compile's passes, and
`map_large_arrays` maps a compile's large arrays on their own."""

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
    elsewhere nothing). The arrays below the mmap threshold (`map_large_arrays`) and
    Python's small objects live on the heap: once a pass drops them, its holes stay
    resident (glibc returns only the heap's top) and count in the peak of the passes
    after it. A few milliseconds a call."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def map_large_arrays() -> bool:
    """Have glibc map every allocation of 4 MiB or more on its own and unmap it when freed
    (for the whole process: `rdma-plan compile` calls it, the library never does). The
    compiler's columns are large, short-lived numpy arrays: with glibc's default (a
    threshold that rises to 32 MiB as such blocks are freed) most of them land on the heap,
    whose holes are kept, not returned, and count in the compile's peak RSS. 4 MiB is where
    numpy asks for transparent huge pages (`madvise`): a mapped array is then faulted in
    2 MiB at a time, while those below stay on the heap and reuse its pages (a lower
    threshold maps arrays that are faulted 4 KiB at a time, their pages zeroed afresh: more
    system time, no lower peak). Whether glibc took it; elsewhere (no glibc) nothing
    changes."""
    libc = _glibc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD) == 1


_M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter (malloc.h); setting it turns the dynamic threshold off."""
_THRESHOLD = 4 << 20
"""Bytes from which an allocation is mapped on its own (`map_large_arrays`)."""


def _glibc():  # noqa: ANN202 (a ctypes library, or None)
    """The process's C library where it has glibc's `malloc_trim` and `mallopt`, looked up
    once; None elsewhere."""
    global _LIBC
    if _LIBC is None:
        _LIBC = False
        try:
            import ctypes

            libc = ctypes.CDLL(None)
            if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt"):
                _LIBC = libc
        except OSError:
            pass
    return _LIBC or None


_LIBC = None
"""`_glibc`'s answer once looked up (False: none)."""
