"""Max-min fair rates for `simulate`'s event loop (`maxmin`), and the cache that reuses them
while the same (egress, ingress) pairs are on (`RateCache`).

`simulate` recomputes the rates of the active flows whenever the set of flows changes:
about once per batch, 207k times for DeepSeek-V3's published plan (2,048 flows each), so
`maxmin` indexes `cap`'s resources directly rather than numbering the resources in use.
The straightforward form that numbers them first (`np.unique`) is the reference in
`tests/support/maxmin_ref.py`; `tests/planner/test_simrates.py` checks that both give the
same rates bit for bit on random flows (every value computed for a resource in use is the
same float operation on the same operands, and resources not in use are never read).
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
    """
    f, n = len(eres), len(cap)
    left = cap.astype(np.float64)
    rate = np.zeros(f)
    idx, level = np.arange(f), 0.0  # unfrozen flows, all at rate `level`
    for _ in range(max_levels):
        ee, ii = eres[idx], ires[idx]
        cnt = np.bincount(ee, minlength=n) + np.bincount(ii, minlength=n)
        used = np.flatnonzero(cnt)
        c = cnt[used]
        share = left[used] / c
        d = share.min()
        level += d
        left[used] -= d * c
        full = np.zeros(n, dtype=bool)
        full[used[share <= d * (1 + 1e-9)]] = True
        frozen = full[ee] | full[ii]
        rate[idx[frozen]] = level
        idx = idx[~frozen]
        if len(idx) == 0:
            return rate
    rate[idx] = level
    free = np.zeros(f, dtype=bool)
    free[idx] = True
    for _ in range(2):
        idx = np.flatnonzero(free)
        ee, ii = eres[idx], ires[idx]
        cnt = np.bincount(ee, minlength=n) + np.bincount(ii, minlength=n)
        share = left / np.maximum(cnt, 1)
        add = np.minimum(share[ee], share[ii])
        rate[idx] += add
        left -= (np.bincount(ee, weights=add, minlength=n) +
                 np.bincount(ii, weights=add, minlength=n))
        full = left <= 1e-9 * cap
        free[idx] = ~(full[ee] | full[ii])
    return rate


class RateCache:
    """Rates of the active flows, reused when the same (egress, ingress) pairs are on as at
    the last computation (as `simulate` has always done). The count, sum and sum of squares
    of the pairs' keys, kept as flows come and go (`on`, `off`), rule most changes out
    without sorting the keys."""

    def __init__(self, n_res: int) -> None:
        self.n = n_res
        self.sum = self.sq = 0
        self.last_sig: tuple[int, int, int] | None = None
        self.last_key = self.last_rate = np.zeros(0)

    def on(self, key: int) -> None:
        self.sum += key
        self.sq += key * key

    def off(self, key: int) -> None:
        self.sum -= key
        self.sq -= key * key

    def rates(self, eres: np.ndarray, ires: np.ndarray, cap: np.ndarray) -> np.ndarray:
        """The rates of flows (`eres`, `ires`): those of the last computation where the
        pairs are the same, else `maxmin`'s."""
        key = eres * self.n + ires
        sig = (len(key), self.sum, self.sq)
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
