"""Pass 6 (`coalesce`): merge writes that are adjacent on both sides; split at the max size.

Two writes merge only when they go from the same source region to the same target region
in the same stage and the second starts exactly where the first ends on both sides.
Merged runs longer than `max_write_bytes` are cut into `max_write_bytes` pieces.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from planner.passes.lower import Lowered
from planner.rows import lexorder

_KEYS = ("w_src_rank", "w_stage", "w_dst_rank", "w_src_region", "w_dst_region")


def coalesce(low: Lowered, max_write_bytes: int) -> Lowered:
    order = lexorder(low.w_src_offset, *(getattr(low, k) for k in reversed(_KEYS)))
    cols = {k: getattr(low, k)[order] for k in (*_KEYS, "w_src_offset", "w_dst_offset",
                                                  "w_nbytes")}
    n = len(order)
    if n == 0:
        return low
    same = np.ones(n, dtype=bool)
    same[0] = False
    for k in _KEYS:
        same[1:] &= cols[k][1:] == cols[k][:-1]
    end_s = cols["w_src_offset"] + cols["w_nbytes"]
    end_d = cols["w_dst_offset"] + cols["w_nbytes"]
    same[1:] &= (cols["w_src_offset"][1:] == end_s[:-1]) & (cols["w_dst_offset"][1:] == end_d[:-1])
    starts = np.nonzero(~same)[0]
    merged = {k: cols[k][starts] for k in (*_KEYS, "w_src_offset", "w_dst_offset")}
    merged["w_nbytes"] = np.add.reduceat(cols["w_nbytes"], starts)
    # Split at max_write_bytes.
    parts = -(-merged["w_nbytes"] // max_write_bytes)
    idx = np.repeat(np.arange(len(starts)), parts)
    k = np.arange(len(idx)) - np.repeat(np.cumsum(parts) - parts, parts)
    shift = k * max_write_bytes
    out = {key: v[idx] for key, v in merged.items()}
    out["w_src_offset"] = out["w_src_offset"] + shift
    out["w_dst_offset"] = out["w_dst_offset"] + shift
    out["w_nbytes"] = np.minimum(max_write_bytes, merged["w_nbytes"][idx] - shift)
    return replace(low, **out)
