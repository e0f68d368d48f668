"""`collector.release_free`: the heap's free pages between live blocks go back to the
system (glibc), where they stayed resident before."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

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


_PROBE = """
import ctypes, sys
from planner.collector import map_large_arrays
if sys.argv[1] == "set":
    assert map_large_arrays()
freed = bytearray(30 << 20)  # a mapped 30 MiB block, freed: glibc's dynamic threshold
del freed                    # rises past 8 MiB
block = bytearray(8 << 20)
addr = ctypes.addressof((ctypes.c_char * 1).from_buffer(block))
with open("/proc/self/maps") as f:
    heap = [line for line in f if line.rstrip().endswith("[heap]")]
lo, hi = (int(x, 16) for x in heap[0].split()[0].split("-")) if heap else (0, 0)
print("heap" if lo <= addr < hi else "mapped")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc(),
                    reason="glibc's mallopt on Linux")
def test_large_arrays_are_mapped_on_their_own() -> None:
    # each case in a process of its own: the threshold is the whole process's
    import subprocess

    def where(mode: str) -> str:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True,
                             text=True, check=True, cwd=root)
        return out.stdout.strip()

    assert where("default") == "heap"  # glibc's default: the 8 MiB block lands on the heap
    assert where("set") == "mapped"
