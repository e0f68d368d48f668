"""Max-min fair rates for `simulate`'s event loop (`maxmin`), and the cache that reuses them
while the same (egress, ingress) pairs are on (`RateCache`).

`simulate` recomputes the rates of the active flows whenever the set of flows changes
(once per landing, or per landing group in the coarse model: thousands of times on a large
plan, with thousands of flows each), so `maxmin` indexes `cap`'s resources directly rather
than numbering the resources in use, and works each level on every resource at once and
on the flows only by a mask of those whose other end saturated in it (few array operations
a level; `maxmin`'s docstring). The straightforward form that numbers them first
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

    A level works on every resource at once and touches the flows only through the
    resources that saturated in it: a saturated resource gets `inf` left (its share is
    `inf` from then on, never the minimum nor saturated again) and notes its level, and
    each resource's count of unfrozen flows loses the flows whose other end saturated
    (a flow is unfrozen while neither end has; the count of a saturated resource is left
    as it falls, never below 0, and never read but divided into `inf`). A flow's rate is
    the level of the first of its two ends to saturate, read once at the end; the level
    after which every flow is frozen shows as a minimum share of `inf`. Every value of a
    resource in use is the same float operation on the same operands as the reference's
    (`tests/support/maxmin_ref.py`; the counts are exact integers either way).
    """
    f, n = len(eres), len(cap)
    if not f:
        return np.zeros(0)
    both = np.concatenate((eres, ires))  # each flow's two (resource, other end) entries
    other = np.concatenate((ires, eres))
    cnt = np.bincount(both, minlength=n)
    left = np.where(cnt > 0, cap, np.inf)
    filled = np.full(n, max_levels, np.int64)  # the level each resource saturated in
    levels: list[float] = []
    level = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):  # (x / 0: no unfrozen flow)
        for k in range(max_levels):
            share = left / cnt
            d = share.min()
            if d == np.inf:
                break  # every flow is frozen
            level += d
            levels.append(level)
            left -= d * cnt
            full = share <= d * (1 + 1e-9)
            left[full] = np.inf  # each loses all its flows now
            filled[full] = k
            cnt = cnt - np.bincount(both[full[other]], minlength=n)
    at = np.minimum(filled[eres], filled[ires])
    levels.append(level)  # (the unfrozen flows' rate after `max_levels`)
    rate = np.array(levels)[np.minimum(at, len(levels) - 1)]
    idx = np.flatnonzero(at == max_levels)
    if not len(idx):
        return rate
    # the closing rounds; `cnt` is each resource's unfrozen flows where one uses it
    ee, ii = eres[idx], ires[idx]
    share = left / np.maximum(cnt, 1)
    add = np.minimum(share[ee], share[ii])
    rate[idx] += add
    left -= (np.bincount(ee, weights=add, minlength=n) +
             np.bincount(ii, weights=add, minlength=n))
    full = left <= 1e-9 * cap
    keep = ~(full[ee] | full[ii])
    idx, ee, ii = idx[keep], ee[keep], ii[keep]
    if len(idx):  # (what is left over after it is read by no one)
        cnt = np.bincount(ee, minlength=n) + np.bincount(ii, minlength=n)
        share = left / np.maximum(cnt, 1)
        rate[idx] += np.minimum(share[ee], share[ii])
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
