"""The reference max-min fair rates: `planner.tools.simrates.maxmin` written the straightforward way
(number the resources in use with `np.unique`, then fill progressively). The simulator runs
the production form; `tests/planner/test_simrates.py` checks both give the same rates bit
for bit."""

from __future__ import annotations

import numpy as np

from planner.tools.simflow import MAX_LEVELS


def maxmin_reference(eres: np.ndarray, ires: np.ndarray, cap: np.ndarray,
                     max_levels: int = MAX_LEVELS) -> np.ndarray:
    """Max-min fair rates of flows that each use resources `eres[f]` and `ires[f]`
    (`planner.tools.simrates.maxmin`'s contract)."""
    res, inv = np.unique(np.concatenate([eres, ires]), return_inverse=True)
    f, n = len(eres), len(res)
    e, i = inv[:f], inv[f:]
    left = cap[res].astype(np.float64)
    rate = np.zeros(f)
    idx, level = np.arange(f), 0.0  # unfrozen flows, all at rate `level`
    for _ in range(max_levels):
        ee, ii = e[idx], i[idx]
        cnt = np.bincount(ee, minlength=n) + np.bincount(ii, minlength=n)
        used = np.nonzero(cnt)[0]
        share = left[used] / cnt[used]
        d = share.min()
        level += d
        left[used] -= d * cnt[used]
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
        idx = np.nonzero(free)[0]
        cnt = np.bincount(e[idx], minlength=n) + np.bincount(i[idx], minlength=n)
        share = left / np.maximum(cnt, 1)
        add = np.minimum(share[e[idx]], share[i[idx]])
        rate[idx] += add
        left -= (np.bincount(e[idx], weights=add, minlength=n) +
                 np.bincount(i[idx], weights=add, minlength=n))
        full = left <= 1e-9 * cap[res]
        free[idx] = ~(full[e[idx]] | full[i[idx]])
    return rate
