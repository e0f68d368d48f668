"""Zero-pause refit (`executor/shadow.py`): the plan writes a shadow while the live tensors keep
version N; `switch` copies it in place. In one process (`local`) and over NIXL between four
processes (`shadow_worker.py`)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from executor import Executor, Shadow, TornUpdateError
from executor.transports.local import Fabric
from schemas.plan import load_plan
from schemas.shadow import shadow_bytes
from tests.support.nixl_world import exited_0, nixl_world
from tests.support.plans import save, two_by_two, two_by_two_expected, two_by_two_tensors

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shadow_worker.py")


def _world(tmp_path, timeout_s: float = 1.5):
    plan = load_plan(save(str(tmp_path / "p.rplan"), two_by_two()))
    fabric = Fabric()
    src = two_by_two_tensors(0)
    live = {t: {k: torch.full_like(v, 7.0) for k, v in src[t].items()} for t in (2, 3)}
    shadows = {t: Shadow(live[t]) for t in (2, 3)}
    sources = [Executor(plan.header, plan.ranks[r], src[r], transport="local", rendezvous=fabric,
                        timeout_s=timeout_s) for r in (0, 1)]
    targets = [Executor(plan.header, plan.ranks[t], shadows[t].tensors, transport="local",
                        rendezvous=fabric,
                        timeout_s=timeout_s) for t in (2, 3)]
    for ex in sources + targets:
        ex.register()
    for ex in sources + targets:
        ex.connect()
    for t, ex in zip((2, 3), targets, strict=True):
        shadows[t].attach(ex)
    return plan, src, live, shadows, sources


def _run_sources(sources: list[Executor], step: int) -> dict[int, BaseException]:
    errs: dict[int, BaseException] = {}

    def go(ex: Executor) -> None:
        try:
            ex.run(step)
        except Exception as e:  # noqa: BLE001 - the test looks at them
            errs[ex.rank] = e
    threads = [threading.Thread(target=go, args=(ex,)) for ex in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return errs


def _refill(src, seed: int) -> None:
    for r, named in two_by_two_tensors(seed).items():
        if r in (0, 1):
            for k, v in named.items():
                src[r][k].copy_(v)


def _equal(live, want) -> bool:
    return all(torch.equal(live[t][k], v) for t in (2, 3) for k, v in want[t].items())


def test_live_keeps_version_n_until_switch_then_equals_n_plus_1_in_place(tmp_path):
    plan, src, live, shadows, sources = _world(tmp_path)
    ptrs = {(t, k): v.data_ptr() for t in (2, 3) for k, v in live[t].items()}
    old = {t: {k: v.clone() for k, v in live[t].items()} for t in (2, 3)}
    for step in (1, 2):
        _refill(src, step)
        for s in shadows.values():
            s.start(step)
        assert _equal(live, old)  # the transfer has not run: sources are idle
        assert not _run_sources(sources, step)
        assert _equal(live, old)  # every byte landed, in the shadow only
        for s in shadows.values():
            assert s.finish(10).complete
        assert _equal(live, old)
        pauses = [s.switch() for s in shadows.values()]
        assert _equal(live, two_by_two_expected(step)) and all(p >= 0 for p in pauses)
        assert {(t, k): v.data_ptr() for t in (2, 3) for k, v in live[t].items()} == ptrs
        old = {t: {k: v.clone() for k, v in live[t].items()} for t in (2, 3)}
        last = shadows[2].last
        assert last is not None and last.version == step and last.transfer_s > 0
    assert shadows[2].extra_bytes == shadow_bytes(plan.ranks[2]) == 2 * 32
    assert shadow_bytes(plan.ranks[0]) == 0


def test_source_that_never_sends_is_a_torn_update_and_the_next_one_is_whole(tmp_path):
    plan, src, live, shadows, sources = _world(tmp_path, timeout_s=1.0)
    _refill(src, 1)
    for s in shadows.values():
        s.start(1)
    _run_sources(sources, 1)
    for s in shadows.values():
        s.finish(10)
        s.switch()
    v1 = {t: {k: v.clone() for k, v in live[t].items()} for t in (2, 3)}
    assert _equal(live, two_by_two_expected(1))
    # step 2: source 0 never runs (source 1 does): no DONE from rank 0 ever comes
    _refill(src, 2)
    for s in shadows.values():
        s.start(2)
    _run_sources(sources[1:], 2)
    for s in shadows.values():
        with pytest.raises(TornUpdateError, match="keep version 1"):
            s.finish(10)
        with pytest.raises(RuntimeError, match="needs a complete update"):
            s.switch()
    assert _equal(live, v1) and all(s.version == 1 for s in shadows.values())
    # the next full update starts clean
    _refill(src, 3)
    for s in shadows.values():
        s.start(3)
    assert not _run_sources(sources, 3)
    for s in shadows.values():
        s.finish(10)
        s.switch()
    assert _equal(live, two_by_two_expected(3)) and all(s.version == 2 for s in shadows.values())


def test_finish_that_times_out_leaves_live_and_the_next_start_joins_the_straggler(tmp_path):
    plan, src, live, shadows, sources = _world(tmp_path, timeout_s=1.0)
    before = {t: {k: v.clone() for k, v in live[t].items()} for t in (2, 3)}
    for s in shadows.values():
        s.start(1)
    for s in shadows.values():
        with pytest.raises(TornUpdateError, match="within 0.05 s"):
            s.finish(0.05)  # nobody sends: the thread still waits for DONE
    assert _equal(live, before)
    _refill(src, 2)
    for s in shadows.values():
        s.start(2)  # joins the thread (the executor's 1 s timeout ends it)
    assert not _run_sources(sources, 2)
    for s in shadows.values():
        s.finish(10)
        s.switch()
    assert _equal(live, two_by_two_expected(2))


def test_shadow_refuses_misuse_with_one_line():
    live = {"w": torch.zeros(4)}
    s = Shadow(live)
    with pytest.raises(RuntimeError, match="attach an executor"):
        s.start()
    with pytest.raises(RuntimeError, match="finish\\(\\) without start"):
        s.finish(1)
    with pytest.raises(TypeError, match="live\\['x'\\] is list"):
        Shadow({"x": [1]})  # type: ignore[dict-item]
    assert s.extra_bytes == 16 and s.tensors["w"].data_ptr() != live["w"].data_ptr()


@pytest.mark.extended
def test_four_nixl_processes_live_keeps_n_until_switch_and_survives_a_silent_source(tmp_path):
    pytest.importorskip("nixl")
    path = save(str(tmp_path / "p.rplan"), two_by_two())
    done = nixl_world(WORKER, path, timeout=240)
    exited_0(done)
    for f in done[2:]:
        out = f.output
        assert f"rank {f.rank} step 1: live kept version 0 during the transfer" in out, out
        assert f"rank {f.rank} step 1: switched, bit-exact, pointers kept" in out, out
        assert f"rank {f.rank} step 2: torn, live kept version 1" in out, out
        assert f"rank {f.rank} step 3: switched, bit-exact, pointers kept" in out, out
