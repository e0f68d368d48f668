"""`assign._greedy`: the heaps of disjoint candidate lists pick what the scan of every
candidate picks (the first of the least loaded), ties included."""

from __future__ import annotations

import numpy as np

from planner.passes.assign import _greedy


def _scan(cands: list[list[int]], of: np.ndarray, nbytes: np.ndarray, load: list[float]
          ) -> list[int]:
    load = list(load)
    out = []
    for c, nb in zip(of.tolist(), nbytes.tolist()):
        k = min(cands[c], key=load.__getitem__)
        load[k] += nb
        out.append(k)
    return out


def test_heaps_pick_as_the_scan_does() -> None:
    rng = np.random.default_rng(5)
    keys = rng.permutation(40).tolist()
    lists = [keys[0:16], keys[16:32], keys[32:33], keys[33:40]]  # disjoint
    cands = [lists[i] for i in rng.integers(0, 4, 300)]
    of = rng.integers(0, len(cands), 5000)
    nbytes = rng.choice([4096.0, 8192.0, 1 << 20], 5000)  # many ties
    load = rng.choice([0.0, 4096.0], 40).tolist()
    assert _greedy(cands, of, nbytes, list(load)) == _scan(cands, of, nbytes, load)


def test_shared_keys_take_the_scan() -> None:
    rng = np.random.default_rng(6)
    cands = [[0, 1, 2], [2, 3], [3, 0]]  # lists share keys: one heap each would go stale
    of = rng.integers(0, 3, 2000)
    nbytes = rng.choice([1.0, 2.0, 3.0], 2000)
    load = [0.0, 0.0, 5.0, 1.0]
    assert _greedy(cands, of, nbytes, list(load)) == _scan(cands, of, nbytes, load)
