"""`planner.heap`: large arrays mapped on their own, or kept on glibc's heap after the
compile's peak (read from glibc's own counters, `mallinfo2`)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from planner import heap

_MIB = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2():
    try:
        libc = ctypes.CDLL(None)
        f = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("no glibc mallinfo2 here")
    f.restype = _Mallinfo2
    return f


def test_large_arrays_go_on_the_heap_only_while_kept() -> None:
    info = _mallinfo2()
    heap.map_large_arrays()
    if heap._libc is None:
        pytest.skip("glibc's mallopt is not there")

    def big() -> tuple[np.ndarray, int]:
        """An array larger than all the heap's free bytes (none of it can be reused), and
        how much glibc's mapped bytes grew with it."""
        n = info().fordblks + 64 * _MIB
        before = info().hblkhd
        a = np.ones(n, dtype=np.uint8)
        return a, info().hblkhd - before

    heap.keep_freed_pages(True)  # outside the scope: nothing
    a, grew = big()
    assert grew >= len(a)  # its own mapping
    del a
    with heap.freed_pages_kept():
        a, grew = big()
        assert grew >= len(a)  # not kept yet
        del a
        heap.keep_freed_pages(True)
        a, grew = big()
        assert grew < 64 * _MIB  # not mapped: on the heap
        del a
        heap.keep_freed_pages(False)
        a, grew = big()
        assert grew >= len(a)  # mapped again
        del a
        heap.keep_freed_pages(True)
    a, grew = big()  # the scope left: mapped again
    assert grew >= len(a)
    del a


def test_keeping_pages_is_a_no_op_unless_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_libc", None)
    with heap.freed_pages_kept():  # no glibc set up: nothing to call, no error
        heap.keep_freed_pages(True)
        heap.keep_freed_pages(False)
