"""Stages where a rank only awaits DONEs (`Executor._quiet`): a target between the stages
it receives in. `run` takes a run of them in one poll where every DONE is in already, else
stage by stage as before; either way the weights land bit-exactly and a missing DONE is
still a timeout naming its stage.

Every rank runs in its own thread over the in-process `local` fabric, on the staged fp32
plan of `test_late_reads.py` (44 stages, writes in flight across stage boundaries)."""

from __future__ import annotations

import os

import pytest
import torch

from executor.core import Executor
from executor.errors import PeerTimeoutError
from executor.transports.local import Fabric
from executor.waits import Signals
from harness.weights import materialize, random_full_tensors
from planner.compiler import compile_config
from planner.frameworks import build_layout
from planner.validate import load
from schemas.plan import load_plan
from schemas.plan_write import write_plan
from tests.support.local_refit import world_tensors
from tests.support.threads import lockstep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "configs", "staged-fp32.yaml")


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    cfg, spec = load(CONFIG)
    path = str(tmp_path_factory.mktemp("quiet") / "p.rplan")
    write_plan(path, compile_config(cfg, spec))
    return path, spec, build_layout(spec, cfg.source), build_layout(spec, cfg.target)


def _run(path: str, spec, src, dst, timeout_s: float = 30, skip_done: int | None = None
         ) -> tuple[list[Executor], list[BaseException], list[str]]:
    """Two steps of the plan, every rank a thread; the executors, the errors raised and the
    target tensors that differ from the sources' last weights. `skip_done`: that source
    rank never sends its DONEs of stages after 0 (a lost signal)."""
    plan = load_plan(path)
    full = [random_full_tensors(spec, seed=11 + k) for k in range(2)]
    sources = {r: [materialize(src, f, ranks=[r])[r] for f in full] for r in range(src.world)}
    tensors = world_tensors(src, dst, full[0])
    fabric = Fabric()
    exs = [Executor(plan.header, rp, tensors[rp.rank], transport="local", rendezvous=fabric,
                    timeout_s=timeout_s) for rp in plan.ranks]
    if skip_done is not None:
        ex = exs[skip_done]
        landed = ex._landed
        ex.window.on_landed = lambda s, handed: landed(s, handed) if s == 0 else None

    def new_weights(ex: Executor, step: int) -> None:
        for name, t in tensors[ex.rank].items() if ex.rank in sources else ():
            t.copy_(sources[ex.rank][step][name])
    errors: list[BaseException] = []
    lockstep(exs, 2, new_weights, errors)
    want = materialize(dst, full[-1])
    bad = [f"rank {src.world + r}: {n}" for r, ts in want.items() for n, w in ts.items()
           if not torch.equal(tensors[src.world + r][n], w)]
    return exs, errors, bad


def test_targets_have_quiet_stages_and_land_bit_exact(staged, monkeypatch):
    calls = {"take_all": 0, "in_at_once": 0}
    take_all = Signals.take_all

    def counted(self, waits):
        calls["take_all"] += 1
        ok = take_all(self, waits)
        calls["in_at_once"] += ok
        return ok

    monkeypatch.setattr(Signals, "take_all", counted)
    exs, errors, bad = _run(*staged)
    assert not errors, errors[0]
    assert not bad, bad
    targets = [ex for ex in exs if ex.plan.role == "target"]
    assert any(sum(ex.quiet) > 1 for ex in targets)
    for ex in exs:  # never a stage that sends, posts, packs or unpacks
        for s, q in enumerate(ex.quiet):
            st = ex.stages[s]
            if q:
                assert not (st.ready_to or st.batches or st.packs or st.unpacks
                            or st.done_to or st.ack_to or st.before), (ex.rank, s)
    assert calls["take_all"] > 0


def test_stage_by_stage_when_not_all_in(staged, monkeypatch):
    monkeypatch.setattr(Signals, "take_all", lambda self, waits: False)
    exs, errors, bad = _run(*staged)
    assert not errors, errors[0]
    assert not bad, bad


def test_a_missing_done_in_a_quiet_stage_times_out_naming_it(staged):
    path, spec, src, dst = staged
    plan = load_plan(path)
    target = next(rp for rp in plan.ranks if rp.role == "target")
    waits = target.waits
    late = [(int(s), int(p)) for s, k, p in zip(waits["stage"], waits["kind"], waits["peer"])
            if int(s) > 0]
    assert late, "the plan's targets await DONEs after stage 0"
    exs, errors, _ = _run(path, spec, src, dst, timeout_s=3, skip_done=late[0][1])
    timeouts = [e for e in errors if isinstance(e, PeerTimeoutError)]
    assert timeouts, errors
    assert any("DONE" in str(e) and "stage" in str(e) for e in timeouts), timeouts
