"""`collector.release_free`: the heap's free pages between live blocks go back to the
system (glibc), where they stayed resident before."""

from __future__ import annotations

import ctypes
import sys

import pytest

from planner.collector import release_free


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "malloc_trim")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc(),
                    reason="glibc's malloc_trim on Linux")
def test_free_heap_pages_go_back() -> None:
    # 64 KiB blocks come from the heap (below glibc's mmap threshold); every other one kept,
    # so the freed ones are holes the heap's top cannot give back
    blocks = [bytearray(64 << 10) for _ in range(4096)]  # 256 MiB, each page touched
    kept = blocks[::2]
    del blocks
    before = _rss_kib()
    release_free()
    after = _rss_kib()
    assert before - after > 64 << 10, (before, after)  # well over 64 of the 128 MiB freed
    assert len(kept) == 2048
    release_free()  # again: nothing more to give, no error
