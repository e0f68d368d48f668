"""Python's cyclic garbage collector paused around work that makes millions of small
objects, none in a cycle: a compile's layouts and columns, a tool's per-rank lists, a
decoded trace or an import. Each is freed by its reference count; the collector's passes
would walk every live one again and again and find nothing to free."""

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
