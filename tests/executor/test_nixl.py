"""The executor over NIXL between 4 processes (2 sources, 2 targets), several steps."""

from __future__ import annotations

import os

import pytest

from tests.support.nixl_world import exited_0, nixl_world
from tests.support.plans import save, two_by_two

pytest.importorskip("nixl")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


@pytest.mark.parametrize("tls", [None, "tcp"])
def test_four_processes_bit_exact_each_step(tmp_path, tls):
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    done = nixl_world(WORKER, path, tail=lambda r: ["3"], **({"UCX_TLS": tls} if tls else {}))
    exited_0(done)
    for f in done:
        assert f"rank {f.rank} step 3: ok" in f.output


def test_source_that_never_runs_times_out_on_its_targets(tmp_path):
    # rank 0 loads (so connect succeeds) but never runs; both targets wait for its DONE
    # and must raise PeerTimeoutError naming rank 0 within their 3 s timeout. Rank 1's
    # part does not depend on rank 0, so it completes.
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    done = nixl_world(WORKER, path, tail=lambda r: ["0" if r == 0 else "1", "nixl", "cpu", "3"])
    assert done[0].returncode == 0 and done[1].returncode == 0, [f.output for f in done[:2]]
    for f in done[2:]:
        assert f.returncode == 3, f.output[-2000:]
        assert f"rank {f.rank}: PeerTimeoutError peer=0 complete=False" in f.output
        assert "within 3 s" in f.output
