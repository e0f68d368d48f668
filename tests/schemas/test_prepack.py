"""The overlap rules: which stages pack early (`schemas/protocol.py`), what the simulator
makes of early packs and of writes in flight across stages, and compiled plans using them.

Hand-built ranks: a source with a 1 GiB staging region; each case lists its packs
(stage, staging byte range written, reads staging?) and its staged writes (stage, staging
byte range read).
"""

from __future__ import annotations

import numpy as np
import pytest

from planner.tools.simulate import simulate
from planner.tools.verify import verify_plan
from schemas.plan import (
    BATCH_COLUMNS,
    COPY_COLUMNS,
    PACK,
    SIGNAL_COLUMNS,
    STAGING,
    UNPACK,
    WRITE_COLUMNS,
    RankPlan,
    Region,
    Table,
)
from schemas.protocol import overlaps, prepacked
from tests.support.plans import GB, NIC_BPS, plan_of, src, tgt

MB = 1 << 20


def _rank(packs: list[tuple[int, int, int, bool]], writes: list[tuple[int, int, int]],
          unpacks: list[tuple[int, int, int]] = (), stages: int = 3) -> RankPlan:
    """packs: (stage, lo, hi, reads staging); writes: (stage, lo, hi) read from staging;
    unpacks: (stage, lo, hi) read from staging. Region 0: a 1 GiB tensor, 1: staging."""
    regions = (Region("w", "bfloat16", (GB // 2,), GB), Region(STAGING, "uint8", (GB,), GB))
    c = {k: [] for k, _ in COPY_COLUMNS}
    for kind, (s, lo, hi, *rest) in [(PACK, p) for p in packs] + [(UNPACK, u) for u in unpacks]:
        from_staging = kind == UNPACK or rest[0]
        row = dict.fromkeys(c, 0)
        row.update(kind=kind, stage=s, src_dtype=1, dst_dtype=1, size0=(hi - lo) // 2,
                   size1=1, size2=1, src_stride0=1, dst_stride0=1,
                   src_region=1 if from_staging else 0, dst_region=0 if kind == UNPACK else 1,
                   src_offset=lo // 2 if kind == UNPACK else 0,
                   dst_offset=0 if kind == UNPACK else lo // 2)
        for k in c:
            c[k].append(row[k])
    w = {k: [] for k, _ in WRITE_COLUMNS}
    b = {k: [] for k, _ in BATCH_COLUMNS}
    for i, (s, lo, hi) in enumerate(writes):
        for k, v in (("dst_rank", 1), ("src_region", 1), ("src_offset", lo),
                     ("dst_region", 0), ("dst_offset", 0), ("nbytes", hi - lo)):
            w[k].append(v)
        for k, v in (("stage", s), ("nic", 0), ("start", i), ("stop", i + 1)):
            b[k].append(v)
    empty = Table.build(SIGNAL_COLUMNS, stage=[], peer=[], kind=[])
    return RankPlan(rank=0, role="source", host=0, gpu=0, nics=("h0/nic0", "nvlink"),
                    regions=regions, writes=Table.build(WRITE_COLUMNS, **w),
                    batches=Table.build(BATCH_COLUMNS, **b),
                    copies=Table.build(COPY_COLUMNS, **c), signals=empty, waits=empty,
                    peer_regions=(), stages=stages)


def test_packs_into_another_third_run_early():
    # stages 0, 1, 2 pack into the thirds [0, 100M), [350M, 450M), [700M, 800M) and send
    # them; stage 3 packs [0, 100M) again: stages 1 and 2 (which may still be in flight)
    # read other bytes -> every stage from 1 on packs early. Stage 2 packing into [0, 100M)
    # instead would clobber what stage 0 (two back) reads: in order.
    thirds = [(0, 100 * MB), (350 * MB, 450 * MB), (700 * MB, 800 * MB), (0, 100 * MB)]
    rp = _rank([(s, lo, hi, False) for s, (lo, hi) in enumerate(thirds)],
               [(s, lo, hi) for s, (lo, hi) in enumerate(thirds)], stages=4)
    assert prepacked(rp).tolist() == [False, True, True, True]
    two = [(0, 100 * MB), (512 * MB, 612 * MB), (0, 100 * MB)]
    rp = _rank([(s, lo, hi, False) for s, (lo, hi) in enumerate(two)],
               [(s, lo, hi) for s, (lo, hi) in enumerate(two)], stages=3)
    assert prepacked(rp).tolist() == [False, True, False]


def test_packs_over_bytes_the_previous_stage_reads_wait():
    # stage 1 packs [50M, 150M) while stage 0's writes read [0, 100M): overlap -> in order.
    rp = _rank([(0, 0, 100 * MB, False), (1, 50 * MB, 150 * MB, False)],
               [(0, 0, 100 * MB), (1, 50 * MB, 150 * MB)], stages=2)
    assert prepacked(rp).tolist() == [False, False]
    # touching ranges do not overlap: [0, 100M) and [100M, 200M)
    rp = _rank([(0, 0, 100 * MB, False), (1, 100 * MB, 200 * MB, False)],
               [(0, 0, 100 * MB), (1, 100 * MB, 200 * MB)], stages=2)
    assert prepacked(rp).tolist() == [False, True]


def test_packs_that_read_staging_or_clobber_an_unpack_wait():
    # stage 1's pack reads staging (a gathered box): its input may not be there yet.
    rp = _rank([(0, 0, 100 * MB, False), (1, 512 * MB, 612 * MB, True)],
               [(0, 0, 100 * MB), (1, 512 * MB, 612 * MB)], stages=2)
    assert prepacked(rp).tolist() == [False, False]
    # stage 1 packs over bytes stage 0 unpacks from (they land during stage 0).
    rp = _rank([(0, 0, 100 * MB, False), (1, 512 * MB, 612 * MB, False)],
               [(0, 0, 100 * MB), (1, 512 * MB, 612 * MB)], unpacks=[(0, 600 * MB, 700 * MB)],
               stages=2)
    assert prepacked(rp).tolist() == [False, False]


def test_overlaps_on_intervals():
    a = (np.array([0, 10]), np.array([5, 20]))
    assert overlaps(a, (np.array([19]), np.array([30])))
    assert not overlaps(a, (np.array([5, 20]), np.array([10, 30])))
    assert not overlaps(a, (np.array([7]), np.array([7])))  # empty interval
    assert overlaps((np.array([0]), np.array([100])), (np.array([1, 50]), np.array([2, 51])))


def _with_staging(plan, rank: int, packs: list[tuple[int, int, int]]):
    """Give rank `rank` of a hand-built plan a staging region, packs (stage, lo, hi) into
    it, and make each stage's writes read what that stage packed."""
    from schemas.plan import Plan
    rp = plan.ranks[rank]
    c = {k: [] for k, _ in COPY_COLUMNS}
    for s, lo, hi in packs:
        row = dict.fromkeys(c, 0)
        row.update(kind=PACK, stage=s, src_dtype=1, dst_dtype=1, size0=(hi - lo) // 2, size1=1,
                   size2=1, src_stride0=1, dst_stride0=1, dst_region=1, dst_offset=lo // 2)
        for k in c:
            c[k].append(row[k])
    regions = (Region("w", "bfloat16", (GB,), 2 * GB), Region(STAGING, "uint8", (GB,), GB))
    w = {k: rp.writes[k].copy() for k, _ in WRITE_COLUMNS}  # each stage sends what it packed
    for stage, a, z in zip(*(rp.batches[k] for k in ("stage", "start", "stop"))):
        lo = next(lo for s, lo, _ in packs if s == stage)
        w["src_region"][a:z] = 1
        w["src_offset"][a:z] = lo + np.concatenate([[0], np.cumsum(w["nbytes"][a:z])[:-1]])
    ranks = list(plan.ranks)
    ranks[rank] = RankPlan(**{**{f: getattr(rp, f) for f in RankPlan.__slots__},
                              "regions": regions, "copies": Table.build(COPY_COLUMNS, **c),
                              "writes": Table.build(WRITE_COLUMNS, **w)})
    return Plan(header=plan.header, ranks=tuple(ranks))


def test_simulated_early_packs_hide_behind_the_writes():
    # Two stages of 0.5 GB (10 ms on the NIC each); packs of 0.5 GB take 2 ms + 10 us.
    # In order: P | W | P | W = 24 ms. Stage 1 packed early (other half of staging):
    # P | W W = 22 ms: its packs ran during stage 0's writes.
    half = GB // 2
    base = plan_of([src(0, 0, (0, 0, 1, half, 1), (1, 0, 1, half, 1)), tgt(1, 0)],
                 pack_us=10.0)
    p, w = half / 250e9 + 10e-6, half / NIC_BPS
    in_order = simulate(_with_staging(base, 0, [(0, 0, half), (1, 0, half)]))
    early = _with_staging(base, 0, [(0, 0, half), (1, half, 2 * half)])
    assert prepacked(early.ranks[0]).tolist() == [False, True]
    res = simulate(early)
    assert in_order["estimated_s"] == pytest.approx(2 * p + 2 * w, rel=1e-4)
    assert res["estimated_s"] == pytest.approx(p + 2 * w, rel=1e-4)
    # stage 1's writes started while stage 0's were still landing (the rank receives
    # nothing in stage 0, so it does not wait for them): the flows overlap in time.
    tl = res["timeline"]
    assert tl["start"][1] <= tl["end"][0]


def test_compiled_plans_pack_early_and_verify():
    """A real compile with a small staging budget (fp32 sources: every chunk is cast, so
    packed): many stages, most packed early, and the plan passes every invariant (incl.
    no peer write landing in early-packed bytes)."""
    from planner.compiler import compile_layouts
    from planner.spec import spec_from_hf
    from tests.support.synthetic import SMALL_HF as HF
    from tests.support.synthetic import fused_col_split, row_split
    from tests.support.synthetic import small_config as _config

    spec = spec_from_hf(HF)
    plan = compile_layouts(_config(staging_bytes=8192, max_write_bytes=4096), spec,
                           row_split(spec, 3, "float32"), fused_col_split(spec, 2, 2))
    stages = max(rp.stages for rp in plan.ranks)
    early = sum(int(prepacked(rp).sum()) for rp in plan.ranks if rp.role == "source")
    later = sum(rp.stages - 1 for rp in plan.ranks if rp.role == "source")
    assert stages > 3 and early >= later // 2, (stages, early, later)
    assert verify_plan(plan) == []
    assert not any(prepacked(rp).any() for rp in plan.ranks if rp.role == "target")


@pytest.mark.parametrize("lands, says", [((750 * MB, 760 * MB), [2]), ((200 * MB, 300 * MB), []),
                                         ((50 * MB, 51 * MB), [])])
def test_verify_finds_early_packs_over_bytes_that_land(lands, says):
    """`verify`'s dataflow: an early stage's packs (the thirds above: stages 1-3 pack early)
    never write staging bytes that the previous stage's incoming writes land in (stage 1's
    landing in stage 2's third is one; one in bytes no early pack writes, or under stage
    3's packs but landing in stage 0, is none of its business)."""
    from planner.tools.verify_rank import rank_dataflow
    from planner.writes import Incoming

    thirds = [(0, 100 * MB), (350 * MB, 450 * MB), (700 * MB, 800 * MB), (0, 100 * MB)]
    rp = _rank([(s, lo, hi, False) for s, (lo, hi) in enumerate(thirds)],
               [(s, lo, hi) for s, (lo, hi) in enumerate(thirds)], stages=4)
    stage = 1 if lands[0] >= 100 * MB else 0
    inc = Incoming(*(np.array([v], np.int64) for v in (2, 1, stage, *lands)))
    msgs = [m for m in rank_dataflow(rp, inc) if "packs early" in m]
    assert [int(m.split("stage ")[1].split()[0]) for m in msgs] == says, msgs
