"""A plan file with two ranks' parts swapped, every digest valid: what a mixed-up or edited
plan file looks like to a loader (each part's `rank` rewritten to its new slot, so the
blob-name check alone does not notice; the header, its identities and the other blobs
untouched)."""

from __future__ import annotations

import dataclasses

from schemas.plan import load_plan
from schemas.plan_write import write_plan


def swap_parts(path: str, a: int, b: int, out: str) -> str:
    """Write `path` with the parts of ranks `a` and `b` exchanged to `out`; returns `out`."""
    plan = load_plan(path)
    ranks = list(plan.ranks)
    ranks[a], ranks[b] = (dataclasses.replace(plan.ranks[b], rank=a),
                          dataclasses.replace(plan.ranks[a], rank=b))
    write_plan(out, dataclasses.replace(plan, ranks=tuple(ranks)))
    return out
