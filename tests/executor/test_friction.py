"""A new user's friction, each with a test that failed before the fix: the demo's
`--transport local`, an unknown transport reported before anything else, the units of
`RunStats` and the bytes a target receives, transport options instead of module globals."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from executor import Executor
from executor.errors import TransportOptionError
from executor.transports.local import Fabric
from executor.transports.options import CudaIpcOptions
from schemas.header import PlanHeader, RankStats
from tests.support.plans import DONE, READY, rank_plan, region

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_an_unknown_transport_is_reported_before_binding_or_rendezvous():
    x = region("x", "uint8", (8,))
    plan = rank_plan(0, "source", [x])
    with pytest.raises(TransportOptionError, match="transport 'nixx' is unknown; use one of"):
        # no tensors, no store
        Executor(PlanHeader(fingerprint="f", world=1), plan, {}, transport="nixx")
    with pytest.raises(TransportOptionError, match=r"transport_options\['stream'\].*streams"):
        Executor(PlanHeader(fingerprint="f", world=1), plan, {}, transport="cuda_ipc",
                 transport_options={"stream": 2})
    with pytest.raises(TransportOptionError, match="= 0: expected a positive int"):
        Executor(PlanHeader(fingerprint="f", world=1), plan, {}, transport="cuda_ipc",
                 transport_options={"streams": 0})


def test_cuda_ipc_options_are_typed_not_module_globals():
    import executor.transports.cuda_ipc as cuda_ipc

    assert not hasattr(cuda_ipc, "STREAMS") and not hasattr(cuda_ipc, "GRAPHS")
    from executor.transports.options import parse
    got = parse("cuda_ipc", CudaIpcOptions, {"streams": 2, "graphs": False})
    assert got == CudaIpcOptions(2, False)


def test_run_stats_say_gbytes_and_targets_report_received_bytes():
    x = region("x", "uint8", (8,))
    src = rank_plan(0, "source", [x], [(0, 1, 0, 0, 0, 0, 8)], signals=[(0, 1, DONE)],
                    waits=[(0, 1, READY)], peer_regions={1: (8,)})
    tgt = rank_plan(1, "target", [x], signals=[(0, 0, READY)], waits=[(0, 0, DONE)])
    header = PlanHeader(fingerprint="f", world=2, rank_stats=(RankStats(1, 8, 0, 0, 0, 0),
                                                           RankStats(0, 0, 8, 0, 0, 0)))
    fabric = Fabric()
    exs = [Executor(header, rp, {"x": torch.arange(8, dtype=torch.uint8)}, transport="local",
                    rendezvous=fabric)
           for rp in (src, tgt)]
    for ex in exs:
        ex.register()
    for ex in exs:
        ex.connect()
    out = {}
    threads = [threading.Thread(target=lambda e=e: out.__setitem__(e.rank, e.run()))
               for e in exs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert (out[0].sent, out[0].received, out[0].bytes) == (8, 0, 8)
    assert (out[1].sent, out[1].received, out[1].bytes) == (0, 8, 8)
    assert not hasattr(out[1], "gbps")  # GB/s, named so: configs' nic_gbps is Gb/s
    assert out[1].gbytes_per_s == pytest.approx(8 / out[1].seconds / 1e9)


@pytest.mark.parametrize("config", ["plans/demo.yaml", "plans/demo-moe.yaml"])
def test_demo_runs_over_the_local_transport(config):
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--config",
                          os.path.join(ROOT, config), "--steps", "1", "--transport", "local"],
                         capture_output=True, text=True, timeout=400,
                         env={**os.environ, "PYTHONPATH": ROOT})
    tail = res.stdout[-2000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert "over local" in res.stdout and "bit-exact after every step: yes" in res.stdout, tail
    rows = [ln for ln in res.stdout.splitlines() if re.match(r"\s+\d+ target ", ln)]
    assert rows and all(not re.search(r"\s0\.00 MB", ln) for ln in rows), tail  # received
