"""A target rank's shadow section (zero-pause refit, `executor/shadow.py`), free of torch.

Compiled only when the config asks (`target.shadow: full` or `target.shadow: {budget_bytes:
N}`, docs/config.md); a plan without it has no `shadow` key in any rank part and is byte for
byte the plan compiled before the section existed. Per target rank (`RankPlan.shadow`):

- `regions` (`SHADOW_REGION_COLUMNS`): the byte ranges of its bound tensors the plan writes
  (the peers' writes and its own UNPACKs into them), disjoint, sorted by (region, offset);
- `switch` (`SWITCH_COLUMNS`): the switch as ops, one shadow -> live copy of `nbytes` bytes
  at `offset` of `region` each, read at `shadow_offset` of the shadow, grouped into `chunk`s
  0, 1, ... (ops in chunk order), layer by layer where the tensor names allow;
- `budget`: 0 for a full shadow (the shadow mirrors each region: `shadow_offset ==
  offset`), else the byte budget of a chunked shadow: each chunk's ops read disjoint ranges
  of one buffer of `budget` bytes (chunk k+1 reuses it after chunk k is switched).

The rules (`shadow_violations`, run by the executor's loader and by `rdma-plan verify`): a
section only on a target; every op inside its region (and, chunked, inside the budget);
the regions disjoint and sorted; the switch covers every byte of the regions exactly once
and nothing else; chunks numbered 0.. in order, none empty; the target's UNPACKs write only
inside the regions. Bounds on the tables, from what they describe (checked first, in time
and memory linear in the tables, so a plan past them is refused before the executor makes
anything per op): at most `MAX_RUNS` runs, coalesced (no two touch: the compiler merges
them); the switch ops coalesced as compiled (no two ops of one chunk touch; at most one op
per run plus one per chunk boundary); at most one chunk per region (a full shadow: one per
layer) plus, chunked, one per `budget` bytes the switch copies. That the regions are
exactly what the peers write into the rank needs the peers' parts:
`planner/tools/verify_shadow.py` (verify only, like `coverage`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .plan import STAGING, UNPACK, RankPlan
from .protocol import ALIGN, copy_extents
from .shadow_part import FIX, SHADOW_REGION_COLUMNS, SWITCH_COLUMNS, ShadowPart

MAX_RUNS = 1 << 18
"""Most byte runs a shadow section lists on one rank (each is one switch op the executor
holds views of; a compiled section has about one per bound tensor)."""
__all__ = ["FIX", "MAX_RUNS", "SHADOW_REGION_COLUMNS", "SWITCH_COLUMNS", "ShadowPart",
           "chunked_bytes", "shadow_bytes", "shadow_violations"]


def _inside(rp: RankPlan, region: np.ndarray, lo: np.ndarray, n: np.ndarray, what: str
            ) -> Iterator[str]:
    names = [r.name for r in rp.regions]
    sizes = np.array([r.nbytes for r in rp.regions] + [0], dtype=np.int64)
    reg = region.astype(np.int64)
    bad_reg = (reg < 0) | (reg >= len(rp.regions))
    if bad_reg.any():
        i = int(np.argmax(bad_reg))
        yield (f"rank {rp.rank}: shadow {what} {i} names region {int(reg[i])}, which it does "
               f"not have; {FIX}")
        return
    stag = np.array([names[r] == STAGING for r in reg.tolist()], dtype=bool)
    bad = stag | (n <= 0) | (lo < 0) | (lo + n > sizes[reg]) | (sizes[reg] >= 1 << 48)
    if bad.any():
        i = int(np.argmax(bad))
        yield (f"rank {rp.rank}: shadow {what} {i} ({names[reg[i]]}, bytes {int(lo[i])}+"
               f"{int(n[i])}) is outside the region's {int(sizes[reg[i]])} bytes (or empty, or"
               f" in staging, or a region of 2**48 bytes or more); {FIX}")


def shadow_violations(rp: RankPlan) -> Iterator[str]:
    """The rules of the module docstring that `rp` alone decides (first failure only)."""
    sh = rp.shadow
    if sh is None:
        return
    if rp.role != "target":
        yield f"rank {rp.rank}: a {rp.role} carries a shadow section (targets only); {FIX}"
        return
    if len(rp.regions) >= 1 << 15:  # (region, byte) is one int64 key below
        yield (f"rank {rp.rank}: a shadow section on a rank of {len(rp.regions)} regions (at "
               f"most 32767); compile without target.shadow")
        return
    g, s = sh.regions, sh.switch
    if len(g) > MAX_RUNS or len(s) > 2 * MAX_RUNS:
        yield (f"rank {rp.rank}: a shadow section of {len(g):,} runs and {len(s):,} switch ops "
               f"(at most {MAX_RUNS:,} runs, each one op plus one per chunk); {FIX}")
        return
    for msg in (*_inside(rp, g["region"], g["offset"], g["nbytes"], "region"),
                *_inside(rp, s["region"], s["offset"], s["nbytes"], "switch op")):
        yield msg
        return
    key = g["region"].astype(np.int64) * (1 << 48)  # region ids < 2**15, bytes < 2**48
    lo, hi = key + g["offset"], key + g["offset"] + g["nbytes"]
    if len(lo) > 1 and (lo[1:] < hi[:-1]).any():
        yield f"rank {rp.rank}: shadow regions overlap or are out of order; {FIX}"
        return
    if len(lo) > 1 and (lo[1:] == hi[:-1]).any():
        yield (f"rank {rp.rank}: shadow regions {int(np.argmax(lo[1:] == hi[:-1]))} and the "
               f"next touch (runs are coalesced when compiled); {FIX}")
        return
    chunk = s["chunk"].astype(np.int64)
    if len(chunk) and (chunk[0] != 0 or (np.diff(chunk) < 0).any()
                       or (np.diff(chunk) > 1).any()):
        yield f"rank {rp.rank}: shadow switch chunks are not numbered 0, 1, ... in order; {FIX}"
        return
    for msg in _counts(rp, sh, chunk, len(g)):
        yield msg
        return
    # the switch covers the regions' bytes exactly once: sorted, its ops tile them
    skey = s["region"].astype(np.int64) * (1 << 48) + s["offset"]
    order = np.argsort(skey, kind="stable")
    s_lo, s_hi = skey[order], skey[order] + s["nbytes"][order]
    if len(s_lo) > 1 and (s_lo[1:] < s_hi[:-1]).any():
        yield f"rank {rp.rank}: two shadow switch ops copy the same byte; {FIX}"
        return
    c = chunk[order]
    if len(s_lo) > 1 and ((s_lo[1:] == s_hi[:-1]) & (c[1:] == c[:-1])).any():
        yield (f"rank {rp.rank}: two shadow switch ops of chunk "
               f"{int(c[1:][np.argmax((s_lo[1:] == s_hi[:-1]) & (c[1:] == c[:-1]))])} copy "
               f"touching bytes (switch ops are coalesced when compiled); {FIX}")
        return
    if not _same_bytes(lo, hi, s_lo, s_hi):
        yield (f"rank {rp.rank}: the shadow switch ops do not cover exactly the shadow regions"
               f" ({int(s['nbytes'].sum())} bytes against {int(g['nbytes'].sum())}); {FIX}")
        return
    if sh.budget == 0 and (s["shadow_offset"] != s["offset"]).any():
        yield f"rank {rp.rank}: a full shadow's switch op reads another offset; {FIX}"
        return
    for msg in (*(_chunked(rp, sh, chunk) if sh.budget else ()), *_unpacks_inside(rp, lo, hi)):
        yield msg
        return


def _counts(rp: RankPlan, sh: ShadowPart, chunk: np.ndarray, runs: int) -> Iterator[str]:
    """The switch's size from what it describes: chunks at most one per region (layer), plus
    one per `budget` bytes where chunked; ops at most one per run plus one per chunk."""
    s = sh.switch
    chunks = int(chunk[-1]) + 1 if len(chunk) else 0
    most = len(rp.regions)
    if sh.budget:
        most += -(-(int(s["nbytes"].sum()) + ALIGN * len(s)) // sh.budget)
    if chunks > most:
        yield (f"rank {rp.rank}: a shadow switch of {chunks:,} chunks for {len(rp.regions)} "
               f"regions (at most {most:,}); {FIX}")
    elif len(s) > runs + max(chunks - 1, 0):
        yield (f"rank {rp.rank}: {len(s):,} shadow switch ops for {runs:,} runs in {chunks:,} "
               f"chunks (at most one op per run plus one per chunk boundary: ops are coalesced "
               f"when compiled); {FIX}")


def _chunked(rp: RankPlan, sh: ShadowPart, chunk: np.ndarray) -> Iterator[str]:
    s = sh.switch
    so, n = s["shadow_offset"].astype(np.int64), s["nbytes"].astype(np.int64)
    if ((so < 0) | (so + n > sh.budget)).any():
        i = int(np.argmax((so < 0) | (so + n > sh.budget)))
        yield (f"rank {rp.rank}: chunked shadow switch op {i} reads bytes {int(so[i])}+"
               f"{int(n[i])}, outside the {sh.budget}-byte budget; {FIX}")
        return
    order = np.lexsort((so, chunk))
    c, a, b = chunk[order], so[order], so[order] + n[order]
    if len(c) > 1 and ((c[1:] == c[:-1]) & (a[1:] < b[:-1])).any():
        yield f"rank {rp.rank}: two switch ops of one chunked shadow chunk share bytes; {FIX}"


def _unpacks_inside(rp: RankPlan, lo: np.ndarray, hi: np.ndarray) -> Iterator[str]:
    """The rank's UNPACKs write only inside its shadow regions (their hull: exact cover is
    verify's, which enumerates every run)."""
    c = rp.copies
    rows = np.flatnonzero(c["kind"] == UNPACK)
    if not len(rows):
        return
    first, last = copy_extents(rp, "dst", rows)
    key = c["dst_region"][rows].astype(np.int64) * (1 << 48)
    a, b = key + first, key + last
    k = np.searchsorted(lo, a, side="right") - 1
    ok = (k >= 0) & (hi[np.maximum(k, 0)] >= b) if len(lo) else np.zeros(len(a), bool)
    if not ok.all():
        i = int(rows[np.argmax(~ok)])
        yield f"rank {rp.rank}: UNPACK {i} writes outside the shadow regions; {FIX}"


def _same_bytes(lo: np.ndarray, hi: np.ndarray, s_lo: np.ndarray, s_hi: np.ndarray) -> bool:
    """Whether two sorted, disjoint interval lists cover the same bytes."""
    def merged(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(a) < 2:
            return a, b
        new = np.ones(len(a), dtype=bool)
        new[1:] = a[1:] != b[:-1]
        starts = np.flatnonzero(new)
        return a[starts], b[np.append(starts[1:], len(a)) - 1]
    (a1, b1), (a2, b2) = merged(lo, hi), merged(s_lo, s_hi)
    return len(a1) == len(a2) and bool((a1 == a2).all() and (b1 == b2).all())


def shadow_bytes(plan: RankPlan) -> int:
    """Extra memory a full shadow costs on `plan`'s rank: the bytes of the tensors it binds
    (a target's weights once more); 0 on a source, which keeps no shadow."""
    if plan.role != "target":
        return 0
    return sum(r.nbytes for r in plan.regions if r.name != STAGING)


def chunked_bytes(plan: RankPlan) -> int | None:
    """A chunked shadow's extra memory on `plan`'s rank (the budget its chunks use), 0 on a
    source, None where the plan was not compiled with a chunked shadow."""
    if plan.role != "target":
        return 0
    sh = plan.shadow
    return sh.budget_used if sh is not None and sh.budget else None
