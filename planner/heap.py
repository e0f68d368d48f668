"""Where glibc puts the compiler's large numpy arrays: each mapped on its own and unmapped
when freed (`map_large_arrays`, what `rdma-plan compile` asks for), or, after the compile's
peak, kept on the heap, whose freed pages the next arrays reuse (`keep_freed_pages`).

A fresh mapping's pages are zeroed by the kernel as they are first touched (about 0.1-0.15
s of system time per GB on the CPU box): a compile makes tens of GB of short-lived columns,
so mapping every one costs seconds. Kept on the heap, freed pages are reused as they are,
but the heap's holes stay in the process's memory: that is only done where the compile's
live memory is below its peak (after `lower`), so the peak is unchanged. Nothing changes
outside `freed_pages_kept` (the command line's compile, after `map_large_arrays`), nor where
there is no glibc."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameters (malloc.h); setting the threshold turns its dynamic
threshold off."""
_THRESHOLD = 4 << 20
"""Bytes from which an allocation is mapped on its own (`map_large_arrays`)."""
_MMAP_MAX = 65536
"""glibc's default most mappings it makes at once (`M_MMAP_MAX`)."""
_TRIM = 128 << 10
"""glibc's default free bytes at the heap's top that it gives back (`M_TRIM_THRESHOLD`)."""
_KEEP_TRIM = (1 << 31) - 1
"""`M_TRIM_THRESHOLD` while freed pages are kept (its largest, a C int): the heap's top is
given back only past 2 GiB free."""

_libc: Any = None
"""glibc, once `map_large_arrays` has set it up; None: `keep_freed_pages` does nothing."""
_active = False
"""Inside `freed_pages_kept` (with glibc set up): `keep_freed_pages` acts."""


def map_large_arrays() -> None:
    """Have glibc map every allocation of 4 MiB or more on its own and unmap it when freed.
    The compiler's columns are large, short-lived numpy arrays: with glibc's default
    (a threshold that rises to 32 MiB as such blocks are freed) most of them land on the
    heap, whose holes are kept, not returned, and count in the compile's peak RSS. 4 MiB is
    where numpy asks for transparent huge pages (`madvise`): a mapped array is then faulted
    in 2 MiB at a time, while those below stay on the heap and reuse its pages (a lower
    threshold maps arrays that are faulted 4 KiB at a time, their pages zeroed afresh: more
    system time, no lower peak). Elsewhere (no glibc) nothing changes."""
    global _libc
    try:
        libc = ctypes.CDLL(None)
        if libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD) and hasattr(libc, "malloc_trim"):
            _libc = libc
    except (OSError, AttributeError):
        pass


@contextmanager
def freed_pages_kept() -> Iterator[None]:
    """The scope in which `keep_freed_pages` acts (the command line's compile, after
    `map_large_arrays`); on leaving it, glibc maps large arrays again (without a walk of
    the heap to give its free pages back: the command ends). Elsewhere (a library caller,
    a test) `keep_freed_pages` does nothing."""
    global _active
    _active = _libc is not None
    try:
        yield
    finally:
        if _active:
            _set(False, give_back=False)
        _active = False


def keep_freed_pages(keep: bool) -> None:
    """`keep`: from now on large arrays go on the heap (no new mappings) and the heap's
    freed pages are kept for the next ones, not given back; else mapped again
    (`map_large_arrays`), and the heap's free pages given back (`malloc_trim`), so the
    process holds only its live memory. A no-op outside `freed_pages_kept`."""
    if _active:
        _set(keep, give_back=True)


def _set(keep: bool, give_back: bool) -> None:
    if keep:
        _libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_TRIM)
        _libc.mallopt(_M_MMAP_MAX, 0)
    else:
        _libc.mallopt(_M_MMAP_MAX, _MMAP_MAX)
        _libc.mallopt(_M_TRIM_THRESHOLD, _TRIM)
        if give_back:
            _libc.malloc_trim(0)
