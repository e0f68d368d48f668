"""`planner.tools.simrates`: the simulator's max-min rates are the straightforward reference's
(`tests/support/maxmin_ref.py`) bit for bit, its rate cache reuses rates only for the same
pairs, and a whole simulation gives the same timeline with them as with the reference
(`maxmin_reference` on every change, the cache compared by sorted keys). `simulate`
reports progress while it runs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import planner.tools.simrates as simrates
import planner.tools.simulate as sim_mod
from planner.tools.simrates import RateCache, maxmin
from planner.tools.simulate import simulate
from tests.support.maxmin_ref import maxmin_reference
from tests.support.synthetic import fsdp2_to_vllm_plan


def _bits(a: np.ndarray) -> list[int]:
    return np.asarray(a, dtype=np.float64).view(np.int64).tolist()


@st.composite
def _flows(draw):
    n = draw(st.integers(2, 12))
    f = draw(st.integers(1, 40))
    e = draw(st.lists(st.integers(0, n - 1), min_size=f, max_size=f))
    i = draw(st.lists(st.integers(0, n - 1), min_size=f, max_size=f))
    caps = draw(st.lists(st.sampled_from([1.0, 3.0, 50e9, 450e9, 7.5, 1e-3]),
                         min_size=n, max_size=n))
    return (np.array(e, dtype=np.int64), np.array(i, dtype=np.int64), np.array(caps),
            draw(st.integers(1, 8)))


@settings(max_examples=300, deadline=None)
@given(_flows())
def test_maxmin_is_the_reference_bit_for_bit(case):
    e, i, cap, levels = case
    assert _bits(maxmin(e, i, cap, levels)) == _bits(maxmin_reference(e, i, cap, levels))


def test_maxmin_past_max_levels():
    # ten targets, each with a distinct number of sources: ten bottleneck levels, so the
    # closing rounds run too
    e = np.arange(55, dtype=np.int64)
    i = np.repeat(np.arange(10), np.arange(1, 11)) + 55
    cap = np.linspace(1.0, 3.0, 65)
    out = maxmin(e, i, cap)
    assert len(set(out.tolist())) > 8
    assert _bits(out) == _bits(maxmin_reference(e, i, cap))


def test_rate_cache_reuses_rates_only_for_the_same_pairs(monkeypatch):
    cap = np.array([5.0, 7.0, 3.0, 2.0, 11.0, 13.0, 4.0, 6.0])
    n = len(cap)
    cache = RateCache(n)
    e, i = np.array([0, 1, 1]), np.array([5, 6, 7])
    first = cache.rates(e, i, cap)
    assert _bits(first) == _bits(maxmin_reference(e, i, cap))
    # the same pairs in another order: the same rates, moved with their flows, not computed
    computed = []
    monkeypatch.setattr(simrates, "maxmin", lambda *a: computed.append(a) or maxmin(*a))
    perm = np.array([2, 0, 1])
    assert _bits(cache.rates(e[perm], i[perm], cap)) == _bits(first[perm])
    assert not computed
    # other pairs with the same count, sum and sum of squares of keys (1, 5, 6 and 2, 3, 7:
    # sums 12, squares 62): computed afresh, not reused
    cache2 = RateCache(1)
    a_e, a_i = np.array([1, 5, 6]), np.zeros(3, dtype=np.int64)
    b_e = np.array([2, 3, 7])
    cap2 = np.array([100.0, 1, 2, 3, 4, 5, 6, 7])  # the egresses are the bottlenecks
    cache2.rates(a_e, a_i, cap2)
    sig = cache2.last_sig
    assert _bits(cache2.rates(b_e, a_i, cap2)) == _bits(maxmin_reference(b_e, a_i, cap2))
    assert cache2.last_sig == sig == (3, 12, 62) and len(computed) == 2
    # keys whose squares wrap in int64 still give equal signatures for equal pairs
    big = RateCache(1 << 33)  # keys of about 2**35, their squares past 2**63
    h_e, h_i = np.array([7, 3]), np.array([5, 6])
    cap3 = np.ones(8)
    big.rates(h_e, h_i, cap3)
    assert len(computed) == 3
    big.rates(h_e[::-1], h_i[::-1], cap3)
    assert len(computed) == 3


class _ReferenceRates:
    """The rates as `simulate` computed them before `planner.tools.simrates`: `maxmin_reference`
    on every change, reused when the sorted pair keys equal the last computation's."""

    def __init__(self, n_res: int) -> None:
        self.n = n_res
        self.last_key: np.ndarray | None = None
        self.last_rate = np.zeros(0)

    def rates(self, eres: np.ndarray, ires: np.ndarray, cap: np.ndarray) -> np.ndarray:
        key = eres * self.n + ires
        order = np.argsort(key, kind="stable")
        if self.last_key is not None and np.array_equal(key[order], self.last_key):
            out = np.empty(len(key))
            out[order] = self.last_rate
            return out
        rate = maxmin_reference(eres, ires, cap)
        self.last_key, self.last_rate = key[order], rate[order]
        return rate


@pytest.mark.parametrize("opts", [{}, {"staging_bytes": 8192, "max_write_bytes": 4096}])
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
@pytest.mark.parametrize("inflight", [1, 3, 8])
def test_simulation_is_the_reference_bit_for_bit(opts, placement, inflight, monkeypatch):
    plan = fsdp2_to_vllm_plan(opts, placement)
    fast = simulate(plan, inflight=inflight)
    monkeypatch.setattr(sim_mod, "RateCache", _ReferenceRates)
    ref = simulate(plan, inflight=inflight)
    assert fast["batches"] > 10
    for k in ("estimated_s", "floor_s", "rank_finish_s", "events", "nics", "gap"):
        assert fast[k] == ref[k], k
    for k, col in ref["timeline"].items():
        assert np.array_equal(fast["timeline"][k], col), k


def test_simulate_reports_batches_landed():
    plan = fsdp2_to_vllm_plan({"staging_bytes": 8192, "max_write_bytes": 4096}, "disaggregated")
    lines: list[str] = []
    res = simulate(plan, progress=lines.append)
    counts = [int(x.split()[1].split("/")[0].replace(",", "")) for x in lines
              if "batches landed" in x]
    assert res["batches"] >= 20 and 2 <= len(counts) <= 10
    assert counts == sorted(counts) and counts[-1] <= res["batches"]
    assert all(x.endswith(f"/{res['batches']:,}") for x in
               (y.split(" batches")[0] for y in lines if "batches landed" in y))
