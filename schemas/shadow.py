"""What a zero-pause refit's full shadow costs (`executor/shadow.py`), free of torch:
`rdma-plan inspect` prints it per rank."""

from __future__ import annotations

from schemas.plan import STAGING, RankPlan


def shadow_bytes(plan: RankPlan) -> int:
    """Extra memory a full shadow costs on `plan`'s rank: the bytes of the tensors it binds
    (a target's weights once more); 0 on a source, which keeps no shadow."""
    if plan.role != "target":
        return 0
    return sum(r.nbytes for r in plan.regions if r.name != STAGING)
