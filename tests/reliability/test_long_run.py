"""The short CI version of bench/long_run.py: 50 steps of plans/demo.yaml over NIXL between
4 processes with weights changing every step; bit-exact checks every 10 steps; no step
fails, nothing registers twice, descriptors and RSS stay flat."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl")


def test_fifty_steps_bit_exact_and_flat():
    from bench.long_run import long_run

    rep = long_run(steps=50, check_every=10)
    assert rep["steps_done"] == 50 and not rep["failures"], rep["failures"]
    assert rep["exact_checks"] == 2 * 5  # both targets, steps 10..50
    assert all(v == 1 for v in rep["registers"].values()), rep["registers"]
    assert all(v <= 0 for v in rep["fds_growth"].values()), rep["fds_growth"]
    # sources allocate nothing per step; targets' checks allocate and free whole models
    for r in (0, 1):
        assert rep["rss_mb_growth"][r] < 8, rep["rss_mb_growth"]
    for r in (2, 3):
        assert rep["rss_mb_growth"][r] < 40, rep["rss_mb_growth"]
