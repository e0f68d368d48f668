"""`verify`'s `shadow` check: a target rank's shadow section (`schemas/shadow.py`) against
what the plan writes into the rank.

After the rank-local rules the executor also runs at load (`schemas.shadow`), the section's
regions are compared with `planner.writes.written` recomputed from the peers' parts: the
same definition the compiler's shadow passes stated in the plan.
"""

from __future__ import annotations

from planner.writes import Incoming, written
from schemas.plan import RankPlan
from schemas.shadow import shadow_violations


def rank_shadow(rp: RankPlan, inc: Incoming) -> list[str]:
    """Violations of `rp`'s shadow section: its own rules, then its regions against what
    the plan writes into the rank (no section: none)."""
    if rp.shadow is None:
        return []
    msgs = list(shadow_violations(rp))[:1]
    if msgs:
        return msgs
    region, off, n = written(rp, inc)
    g = rp.shadow.regions
    same = len(region) == len(g) and bool(
        (g["region"] == region).all() and (g["offset"] == off).all()
        and (g["nbytes"] == n).all())
    if same:
        return []
    return [f"rank {rp.rank}: its shadow regions ({len(g)} runs, {int(g['nbytes'].sum())} "
            f"bytes) are not the bytes the plan writes into it ({len(region)} runs, "
            f"{int(n.sum())} bytes); the plan is corrupt or was tampered with: recompile it"]
