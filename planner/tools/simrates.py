"""Max-min fair rates for `simulate`'s event loop (`maxmin`), and the cache that reuses them
while the same (egress, ingress) pairs are on (`RateCache`).

`simulate` recomputes the rates of the active flows whenever the set of flows changes
(once per landing, or per landing group in the coarse model: thousands of times on a large
plan, with thousands of flows each), so `maxmin` indexes `cap`'s resources directly rather
than numbering the resources in use, and works each level on every resource and flow at
once (few array operations a level). The straightforward form that numbers them first
(`np.unique`) is the reference in `tests/support/maxmin_ref.py`;
`tests/planner/test_simrates.py` checks that both give the same rates bit for bit on random
flows (every value computed for a resource in use is the same float operation on the same
operands, and what is kept for resources not in use is never read).
"""

from __future__ import annotations

import numpy as np

from planner.tools.simflow import MAX_LEVELS


def maxmin(eres: np.ndarray, ires: np.ndarray, cap: np.ndarray,
           max_levels: int = MAX_LEVELS) -> np.ndarray:
    """Max-min fair rates of flows that each use resources `eres[f]` and `ires[f]`
    (indices into `cap`).

    Progressive filling: raise every unfrozen flow's rate until a resource saturates,
    freeze the flows through it, repeat. After `max_levels` levels, flows still unfrozen
    get the fair share of their tighter resource's leftover, twice: a feasible allocation
    a little below max-min (exact when there are at most `max_levels` bottleneck levels).

    A level works on every resource and flow at once (a resource's count of unfrozen
    flows, a mask of the unfrozen flows): fewer array operations than numbering the
    resources in use each level. A resource with no unfrozen flow has `inf` left, so its
    share is `inf` and it is never the minimum nor saturated; a saturated one loses all
    its flows at once and gets `inf` then. Every value of a resource in use is the same
    float operation on the same operands as the reference's.
    """
    f, n = len(eres), len(cap)
    rate = np.zeros(f)
    if not f:
        return rate
    cnt = np.bincount(eres, minlength=n) + np.bincount(ires, minlength=n)
    left = np.where(cnt > 0, cap.astype(np.float64), np.inf)
    alive = np.ones(f, dtype=bool)  # unfrozen flows, all at rate `level`
    level = 0.0
    with np.errstate(divide="ignore"):  # (inf / 0: a resource out of use)
        for _ in range(max_levels):
            share = left / cnt
            d = share.min()
            level += d
            left -= d * cnt
            full = share <= d * (1 + 1e-9)
            left[full] = np.inf  # each loses all its flows now
            frozen = full[eres] | full[ires]
            frozen &= alive
            rate[frozen] = level
            alive ^= frozen
            if not alive.any():
                return rate
            cnt = np.bincount(eres, alive, n) + np.bincount(ires, alive, n)
    rate[alive] = level
    free = alive
    for last in (False, True):
        idx = np.flatnonzero(free)
        ee, ii = eres[idx], ires[idx]
        cnt = np.bincount(ee, minlength=n) + np.bincount(ii, minlength=n)
        share = left / np.maximum(cnt, 1)
        add = np.minimum(share[ee], share[ii])
        rate[idx] += add
        if last:  # (what is left over after it is read by no one)
            return rate
        left -= (np.bincount(ee, weights=add, minlength=n) +
                 np.bincount(ii, weights=add, minlength=n))
        full = left <= 1e-9 * cap
        free[idx] = ~(full[ee] | full[ii])
    return rate


class RateCache:
    """Rates of the active flows, reused when the same (egress, ingress) pairs are on as at
    the last computation (as `simulate` has always done). The count, sum and sum of squares
    of the pairs' keys (wrapping in int64: equal pairs always give equal sums) rule most
    changes out without sorting the keys."""

    def __init__(self, n_res: int) -> None:
        self.n = n_res
        self.last_sig: tuple[int, int, int] | None = None
        self.last_key = self.last_rate = np.zeros(0)

    def rates(self, eres: np.ndarray, ires: np.ndarray, cap: np.ndarray) -> np.ndarray:
        """The rates of flows (`eres`, `ires`): those of the last computation where the
        pairs are the same, else `maxmin`'s."""
        key = eres * self.n + ires
        sig = (len(key), int(key.sum()), int((key * key).sum()))
        if sig == self.last_sig:  # perhaps the same pairs: compare them
            order = np.argsort(key, kind="stable")
            last = np.argsort(self.last_key, kind="stable")
            if np.array_equal(key[order], self.last_key[last]):
                out = np.empty(len(key))
                out[order] = self.last_rate[last]
                return out
        rate = maxmin(eres, ires, cap)
        self.last_sig, self.last_key, self.last_rate = sig, key, rate
        return rate
