"""Switching plans at a step boundary (an expert placement change) without registering the
memory again: 4 processes over NIXL, step 1 with plan A, steps 2 and 3 with plan B
(replanned), bit for bit; a plan for other memory or another placement refused in one line.
The same over CUDA IPC on a GPU: test_plan_switch_cuda_ipc.py."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from executor.plan_switch import refusal
from schemas.plan import Region
from tests.support.nixl_world import exited_0, nixl_world
from tests.support.placement_plans import write_plans

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "switch_worker.py")


def test_switch_at_a_step_boundary_is_bit_exact_without_registering_again(tmp_path):
    pytest.importorskip("nixl")
    plan_a, plan_b = write_plans(str(tmp_path))
    moved = [r for r in range(plan_a.header.sources)
             if not np.array_equal(plan_a.ranks[r].writes["src_region"],
                                   plan_b.ranks[r].writes["src_region"])]
    assert moved, "placement B moves no write: the test would show nothing"
    done = nixl_world(WORKER, str(tmp_path), timeout=300)
    exited_0(done)
    for f in done:
        assert f"rank {f.rank}: ok" in f.output
        assert (f"rank {f.rank}: registrations after load 0, exports 0, peer imports 0, "
                f"register_calls 1, switches 1, fingerprint {plan_b.header.fingerprint[:16]}"
                ) in f.output
    for f in done[2:]:  # the engine's placement is B: plan A refused, in one line
        line = next(x for x in f.output.splitlines() if x.startswith(f"rank {f.rank} refused"))
        assert "compiled for placement" in line and "replan" in line


def test_a_plan_for_other_memory_or_peers_is_refused_in_one_line(tmp_path):
    plan_a, plan_b = write_plans(str(tmp_path))
    h, rank = plan_a.header, plan_a.ranks[2]
    assert refusal(h, rank, plan_b.header, plan_b.ranks[2], [0, 1, 3]) is None
    bigger = dataclasses.replace(rank, regions=(
        Region(rank.regions[0].name, rank.regions[0].dtype, rank.regions[0].shape,
               rank.regions[0].nbytes + 2), *rank.regions[1:]))
    other = [
        (plan_b.ranks[3], "the new part is rank 3"),
        (bigger, "region 0 differs"),
    ]
    for part, words in other:
        why = refusal(h, rank, plan_b.header, part, [0, 1, 3])
        assert why is not None and words in why and "\n" not in why
        assert "load the new plan instead" in why
    why = refusal(h, plan_a.ranks[0], plan_b.header, plan_b.ranks[0], [])
    assert why is not None and "not connected" in why
    unrelated = dataclasses.replace(plan_b.header, placement_base="0" * 64)
    why = refusal(h, rank, unrelated, plan_b.ranks[2], [0, 1, 3])
    assert why is not None and "not the loaded one for another expert placement" in why


def test_a_switch_drops_what_arrived_of_the_old_plan():
    # a signal of a later step that arrived under plan A (a peer went on with it) must not
    # satisfy plan B's wait of the same key: keys do not carry the plan's tag
    from executor import signals as sg
    from executor.auth import keys_from
    from schemas.plan import READY

    keys, tag_a, tag_b = keys_from(b"k" * 32), sg.fingerprint_tag("a"), sg.fingerprint_tag("b")
    box = sg.Inbox(tag_a, incarnation=7, rank=1, keys=keys)
    box.set_incarnation(0, 100)
    box.add([("", sg.encode(keys, tag_a, 100, 7, 2, 0, READY, 0, 1))], step=1)
    key = sg.expected(2, 0, READY, 0)
    assert key in box.arrived
    box.retag(tag_b)
    assert box.take([key]) == [key]
    box.add([("", sg.encode(keys, tag_a, 100, 7, 2, 0, READY, 0, 2))], step=2)  # still A's
    assert box.take([key]) == [key]
    box.add([("", sg.encode(keys, tag_b, 100, 7, 2, 0, READY, 0, 3))], step=2)
    assert box.take([key]) == []
