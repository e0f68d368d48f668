"""Errors before anything moves: bind mismatches, out-of-bounds ops, peers that differ,
and peers that never run (timeouts name the peer, on both sides)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from executor import (
    BindError,
    Executor,
    PeerMismatchError,
    PeerTimeoutError,
    PlanBoundsError,
)
from executor.transports.local import Fabric
from schemas.header import PlanHeader
from tests.support.clock import within_guard
from tests.support.plans import (
    BF16,
    DONE,
    F32,
    PACK,
    READY,
    STAGING,
    copy,
    rank_plan,
    region,
    two_by_two,
    two_by_two_tensors,
)

HEADER = PlanHeader(fingerprint="fp-a", world=4)


def _pair(src, tgt, tensors, headers=(HEADER, HEADER), timeout_s=1.0):
    """Source and target executors sharing one in-process fabric, registered and connected."""
    fabric = Fabric()
    exs = [Executor(h, rp, tensors[rp.rank], transport="local", rendezvous=fabric,
                    timeout_s=timeout_s)
           for h, rp in zip(headers, (src, tgt))]
    for ex in exs:
        ex.register()
    for ex in exs:
        ex.connect()
    return exs


def _simple(nbytes=8, dst_offset=0, src_offset=0, peer_size=8):
    # source 0 "x" [8] u8 -> target 1 "x" [8] u8, one write; READY then DONE
    x = region("x", "uint8", (8,))
    src = rank_plan(0, "source", [x], [(0, 1, 0, src_offset, 0, dst_offset, nbytes)],
                    signals=[(0, 1, DONE)], waits=[(0, 1, READY)],
                    peer_regions={1: (peer_size,)})
    tgt = rank_plan(1, "target", [x], signals=[(0, 0, READY)], waits=[(0, 0, DONE)])
    return src, tgt


def _u8():
    return {0: {"x": torch.arange(8, dtype=torch.uint8)},
            1: {"x": torch.zeros(8, dtype=torch.uint8)}}


def test_bind_lists_every_problem():
    tensors = two_by_two_tensors(0)[0]
    tensors["w"] = torch.zeros(2, 8, dtype=torch.float32)  # wrong dtype
    tensors["b"] = torch.zeros(6, 4).t()  # right shape, not contiguous
    tensors["unused"] = torch.zeros(3)  # extra names are fine
    with pytest.raises(BindError) as e:
        Executor(HEADER, two_by_two()[0], tensors, transport="local", rendezvous=Fabric())
    msg = str(e.value)
    assert "2 tensor(s)" in msg and "w: dtype float32 != plan bfloat16" in msg
    assert "b: not contiguous" in msg and "unused" not in msg
    tensors = {"w": torch.zeros(3, 8, dtype=torch.bfloat16)}
    with pytest.raises(BindError, match=r"w: shape \[3, 8\] != plan \[2, 8\][\s\S]*b: missing"):
        Executor(HEADER, two_by_two()[0], tensors, transport="local", rendezvous=Fabric())


def test_staging_is_allocated_by_the_executor():
    ex = Executor(HEADER, two_by_two()[0], two_by_two_tensors(0)[0], transport="local",
                  rendezvous=Fabric())
    assert ex.plan.regions[-1].name == STAGING and ex.regions[-1].numel() == 16


@pytest.mark.parametrize("plan_args, why", [
    ({"dst_offset": 4}, "writes past the end of its dst region on rank 1"),
    ({"src_offset": 1}, "reads past the end of its local src region"),
    ({"peer_size": 4}, "writes past the end of its dst region on rank 1"),
    ({"nbytes": -1}, "negative or huge"),
])
def test_out_of_bounds_write_is_rejected_before_posting(plan_args, why):
    src, tgt = _simple(**plan_args)
    fabric = Fabric()
    with pytest.raises(PlanBoundsError, match=why):
        Executor(HEADER, src, _u8()[0], transport="local", rendezvous=fabric)
    assert not fabric.regions and not fabric.kv  # nothing registered, nothing published


def test_copy_stride_overflow_is_rejected():
    # PACK a 2 x 4 box of fp32 "b" [4, 6] with row stride 7: last element 1 + 7 + 3 = 11 is
    # fine, with row stride 21 it is 1 + 21 + 3 = 25 >= 24 elements
    b, st = region("b", "float32", (4, 6)), region(STAGING, "uint8", (16,))
    for stride, ok in ((7, True), (21, False)):
        c = copy(PACK, 0, (0, F32, 1, (stride, 1, 0)), (1, BF16, 0, (4, 1, 0)), (2, 4, 1))
        rp = rank_plan(0, "source", [b, st], copies=[c])
        if ok:
            Executor(HEADER, rp, {"b": torch.zeros(4, 6)}, transport="local", rendezvous=Fabric())
        else:
            with pytest.raises(PlanBoundsError, match="past the end of its src region"):
                Executor(HEADER, rp, {"b": torch.zeros(4, 6)}, transport="local",
                         rendezvous=Fabric())


def test_peer_with_another_plan_or_other_sizes_is_refused():
    src, tgt = _simple()
    with pytest.raises(PeerMismatchError, match="peer rank 1 loaded plan 'fp-b'"):
        _pair(src, tgt, _u8(), headers=(HEADER, dataclasses.replace(HEADER, fingerprint="fp-b")))
    src, tgt = _simple()
    x4 = region("x", "uint8", (4,))
    tgt = rank_plan(1, "target", [x4], signals=[(0, 0, READY)], waits=[(0, 0, DONE)])
    tensors = {**_u8(), 1: {"x": torch.zeros(4, dtype=torch.uint8)}}
    with pytest.raises(PeerMismatchError,
                       match=r"peer rank 1 exported region 0 of 4 bytes, the plan expects 8"):
        _pair(src, tgt, tensors)


def test_source_that_never_runs_times_out_on_the_target():
    src_ex, tgt_ex = _pair(*_simple(), _u8(), timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="peer rank 0 did not send DONE") as e:
        tgt_ex.run()
    waited = time.monotonic() - t0
    assert e.value.peer == 0  # the plan's 0.5 s, not a default's minutes: a generous guard
    within_guard(waited, 2.0, "a 0.5 s timeout")
    assert not tgt_ex.complete
    # the source runs step 1 late and alone: the target's ABORT voided its READY of step 1
    # (docs/reliability.md), so the source does not write on it and times out too
    with pytest.raises(PeerTimeoutError, match="peer rank 1 did not send READY"):
        src_ex.run()
    assert not torch.any(tgt_ex.regions[0])
    # run together again: both recover to the same step and the data lands
    late = threading.Thread(target=src_ex.run)
    late.start()
    stats = tgt_ex.run()
    late.join(timeout=10)
    assert stats.complete and tgt_ex.complete and src_ex.step == tgt_ex.step
    assert torch.equal(tgt_ex.regions[0], torch.arange(8, dtype=torch.uint8))


def test_target_that_never_runs_times_out_on_the_source():
    src_ex, _ = _pair(*_simple(), _u8(), timeout_s=0.3)
    with pytest.raises(PeerTimeoutError, match="peer rank 1 did not send READY"):
        src_ex.run()


def test_peer_that_never_loads_times_out_at_connect():
    src, _ = _simple()
    ex = Executor(HEADER, src, _u8()[0], transport="local", rendezvous=Fabric(), timeout_s=0.2)
    ex.register()
    with pytest.raises(PeerTimeoutError, match="peer rank 1 did not publish its regions"):
        ex.connect()


def test_rank_plans_that_disagree_with_the_header_are_refused():
    import dataclasses

    src, _ = _simple()
    with pytest.raises(PlanBoundsError, match="has 2 stage.*header says 1"):
        Executor(dataclasses.replace(HEADER, stages=1), dataclasses.replace(src, stages=2),
                 _u8()[0], transport="local", rendezvous=Fabric())
    with pytest.raises(PlanBoundsError, match="stages is 1099511627776 \\(at most"):
        Executor(HEADER, dataclasses.replace(src, stages=2**40), _u8()[0], transport="local",
                 rendezvous=Fabric())
    with pytest.raises(PlanBoundsError, match="names rank 1, outside the plan's world of 1"):
        Executor(dataclasses.replace(HEADER, world=1), src, _u8()[0], transport="local",
                 rendezvous=Fabric())
