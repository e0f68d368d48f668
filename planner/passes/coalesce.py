"""Pass 9 (`coalesce`): merge writes that are adjacent on both sides; split at the max size.

Two writes merge only when they go from the same source region to the same target region
in the same stage and the second starts exactly where the first ends on both sides.
Merged runs longer than `max_write_bytes` are cut into `max_write_bytes` pieces.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from planner.passes.lower import Lowered
from planner.rows import grouped_order, smallest_int

_KEYS = ("w_src_rank", "w_stage", "w_dst_rank", "w_src_region", "w_dst_region")
_EMPTY = np.zeros(0, dtype=np.int64)


def coalesce(low: Lowered | list[Lowered], max_write_bytes: int) -> Lowered:
    """`low` with adjacent writes merged and runs cut at `max_write_bytes`. Columns are
    put in order one at a time (a sorted copy of the whole table is never held). `low` may
    be a list holding the only reference to it: the list is emptied and each input column
    dropped as soon as its merged column is made (the input and the merged writes are then
    never held whole together)."""
    own = isinstance(low, list)
    if isinstance(low, list):
        held = low
        (low,) = held
        held.clear()
    cols = {k: getattr(low, k) for k in Lowered.__slots__ if k.startswith("w_")}
    # the merged columns keep their dtypes, but ranks, stages and regions are int32 at
    # least (`lower` may hold them narrower)
    dtypes = {k: np.promote_types(c.dtype, np.int32) if k in _KEYS else c.dtype
              for k, c in cols.items()}
    if own:  # the writes' columns are held here alone; the rest stays in `low`
        low = replace(low, **{k: _EMPTY for k in cols})
        for k in _KEYS:  # ranks, stages, regions: narrower while held for the sort
            cols[k] = smallest_int(cols[k])
    # by (keys, source offset); `same`: a row's keys equal the row's before it
    order, same = grouped_order([cols[k] for k in _KEYS], cols["w_src_offset"])
    n = len(order)
    if n == 0:
        return replace(low, **{k: c.astype(dtypes[k], copy=False) for k, c in cols.items()})
    nbytes = cols.pop("w_nbytes")[order]
    for k in ("w_src_offset", "w_dst_offset"):
        off = cols[k][order]
        same[1:] &= off[1:] == off[:-1] + nbytes[:-1]
        del off
    starts = np.nonzero(~same)[0]
    del same
    first = order[starts]
    del order
    merged_bytes = np.add.reduceat(nbytes, starts)
    del nbytes, starts
    merged = {}
    for k in (*_KEYS, "w_src_offset", "w_dst_offset"):  # each input column goes once taken
        merged[k] = cols.pop(k)[first].astype(dtypes[k], copy=False)
    del first
    merged["w_nbytes"] = merged_bytes
    # Split at max_write_bytes.
    parts = -(-merged_bytes // np.int64(max_write_bytes))  # (int64: any int32 bytes)
    if (parts == 1).all():  # nothing to cut (a 0-byte run would go: below)
        return replace(low, **merged)
    idx = np.repeat(np.arange(len(parts)), parts)
    k = np.arange(len(idx)) - np.repeat(np.cumsum(parts) - parts, parts)
    shift = k * max_write_bytes
    out = {key: merged.pop(key)[idx] for key in list(merged)}  # each goes once cut
    out["w_src_offset"] = out["w_src_offset"] + shift
    out["w_dst_offset"] = out["w_dst_offset"] + shift
    out["w_nbytes"] = np.minimum(max_write_bytes, merged_bytes[idx] - shift)
    return replace(low, **out)
