"""`planner.tools.verify` can fail: each check reports a fault planted in a good plan.

The plan: the small qwen3 of tests/planner/test_compile_synthetic.py, a 4-way fused
column split in float32 (sources) -> a 2-way fused column split x 2 replicas in bf16
(targets) on 2 hosts of 4 GPUs (colocated), staging 4096 bytes: casts (packs), strided
target boxes (unpacks), several stages with ACKs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner.compiler import compile_layouts
from planner.spec import spec_from_hf
from planner.tools import verify
from schemas.config import ClusterConfig, Config, ModelConfig, Options, SourceConfig, TargetConfig
from schemas.plan import ACK, DONE, PACK, STAGING, Plan, RankPlan, Table
from tests.support.synthetic import SMALL_HF as HF
from tests.support.synthetic import fused_col_split


@pytest.fixture(scope="module")
def plan() -> Plan:
    spec = spec_from_hf(HF)
    cfg = Config(model=ModelConfig("unused"), source=SourceConfig("fsdp2", dp=4),
                 target=TargetConfig("vllm", tp=2, replicas=2),
                 cluster=ClusterConfig(gpus_per_host=4, nics_per_host=2,
                                       placement="colocated", source_gpus_per_host=2),
                 options=Options(staging_bytes=4096, max_write_bytes=4096))
    p = compile_layouts(cfg, spec, fused_col_split(spec, 4, 1, "float32"),
                        fused_col_split(spec, 2, 2))
    assert verify.verify_plan(p) == []
    assert p.header.stages > 1 and p.header.stats.unpacks > 0
    return p


def _edit(plan: Plan, rank: int, **tables: Table | tuple) -> Plan:
    ranks = list(plan.ranks)
    ranks[rank] = dataclasses.replace(ranks[rank], **tables)
    return dataclasses.replace(plan, ranks=tuple(ranks))


def _rows(t: Table, keep: np.ndarray, **set_cols: np.ndarray) -> Table:
    cols = {n: np.array(t[n])[keep] for n, _ in t.schema}
    cols.update(set_cols)
    return Table.build(t.schema, **cols)


def _writer(plan: Plan) -> RankPlan:
    return next(rp for rp in plan.ranks if len(rp.writes) > 2)


def test_dropped_write_is_a_coverage_gap(plan: Plan) -> None:
    rp = _writer(plan)
    w, b = rp.writes, rp.batches
    keep = np.arange(len(w)) != len(w) - 1
    bad = _edit(plan, rp.rank, writes=_rows(w, keep),
                batches=_rows(b, np.ones(len(b), bool), stop=np.minimum(b["stop"],
                                                                         len(w) - 1)))
    bad = _edit(bad, rp.rank, batches=_rows(bad.ranks[rp.rank].batches,
                                            bad.ranks[rp.rank].batches["stop"] >
                                            bad.ranks[rp.rank].batches["start"]))
    problems = verify.verify_plan(bad)
    assert any("bytes written per run" in p or "no write of its stage fills" in p
               for p in problems), problems


def test_duplicated_write_is_an_overlap(plan: Plan) -> None:
    rp = _writer(plan)
    w, b = rp.writes, rp.batches
    keep = np.append(np.arange(len(w)), len(w) - 1)  # the last write twice
    stop = np.array(b["stop"])
    stop[-1] += 1
    bad = _edit(plan, rp.rank, writes=_rows(w, keep),
                batches=_rows(b, np.ones(len(b), bool), stop=stop))
    assert any("overlap" in p for p in verify.verify_plan(bad))


def test_oversized_write_and_staging_are_reported(plan: Plan) -> None:
    opts = dataclasses.replace(plan.header.options)  # below what a config may ask for
    object.__setattr__(opts, "max_write_bytes", 8)
    object.__setattr__(opts, "staging_bytes", 8)
    problems = verify.sizes(dataclasses.replace(plan, header=dataclasses.replace(
        plan.header, options=opts)))
    assert any("exceeds max_write_bytes" in p for p in problems)
    assert any("exceeds staging_bytes" in p for p in problems)


def test_staging_beyond_what_the_ops_use_is_reported(plan: Plan) -> None:
    # The budget is a cap: a staging region one slot (4096 bytes) larger than the bytes its
    # rank's ops touch is what staging allocated by budget looked like.
    rp = next(rp for rp in plan.ranks if rp.regions and rp.regions[-1].name == STAGING)
    n = rp.regions[-1].nbytes + 4096
    regions = (*rp.regions[:-1], dataclasses.replace(rp.regions[-1], shape=(n,), nbytes=n))
    assert verify.staging_fit(plan) == []
    problems = verify.staging_fit(_edit(plan, rp.rank, regions=regions))
    assert len(problems) == 1 and "exceeds what its ops use at peak" in problems[0]


def test_pack_in_the_wrong_stage_is_a_dataflow_error(plan: Plan) -> None:
    rp = next(r for r in plan.ranks if (r.copies["kind"] == PACK).any()
              and len(set(r.copies["stage"].tolist())) > 1)
    c = rp.copies
    stage = np.array(c["stage"])
    i = int(np.flatnonzero(c["kind"] == PACK)[0])
    stage[i] = (stage[i] + 1) % rp.stages
    bad = _edit(plan, rp.rank, copies=_rows(c, np.ones(len(c), bool), stage=stage))
    assert verify.dataflow(bad) != []


@pytest.mark.parametrize("kind", [DONE, ACK])
def test_missing_signal_is_an_order_error(plan: Plan, kind: int) -> None:
    rp = next(r for r in plan.ranks if (r.signals["kind"] == kind).any())
    s = rp.signals
    keep = np.arange(len(s)) != int(np.flatnonzero(s["kind"] == kind)[0])
    assert verify.order(_edit(plan, rp.rank, signals=_rows(s, keep))) != []


def test_staged_write_without_its_ack_is_an_order_error(plan: Plan) -> None:
    # a writer's ACK wait dropped with the ACK that answered it (every signal still pairs):
    # where its next stage's writes land in staging bytes the target still reads, verify
    # says so (`verify._acks`), and never of a pair whose signals are intact
    from schemas.protocol import sent_stage

    found = 0
    for rp in plan.ranks:
        g = rp.waits
        for j in np.flatnonzero(g["kind"] == ACK).tolist():
            peer, stage = int(g["peer"][j]), int(g["stage"][j])
            s = plan.ranks[peer].signals
            drop = (s["kind"] == ACK) & (s["peer"] == rp.rank) \
                & (s["stage"] == sent_stage(ACK, stage))
            assert drop.sum() == 1
            bad = _edit(_edit(plan, rp.rank, waits=_rows(g, np.arange(len(g)) != j)),
                        peer, signals=_rows(s, ~drop))
            msgs = verify.order(bad)
            assert not any("never sent" in m or "nobody waits" in m for m in msgs)
            found += any(f"rank {rp.rank} writes into rank {peer}'s staging in stage {stage}"
                         in m and "may still read" in m for m in msgs)
    assert found > 0


def test_unbalanced_nics_are_reported(plan: Plan) -> None:
    # Pretend rank 0's remote batches went over NVLink: the other source NICs carry all.
    egress = verify.nic_egress(plan)
    assert len(egress) >= 2 and verify.balance(plan, replicated=True) == []
    skewed = plan
    for rp in plan.ranks[1:]:
        if rp.role == "source":
            b = rp.batches
            skewed = _edit(skewed, rp.rank, batches=_rows(
                b, np.ones(len(b), bool), nic=np.ones(len(b), np.int64)))
    assert sum(verify.nic_egress(skewed).values()) < sum(egress.values())
    assert verify.balance(skewed, replicated=True) != []


def test_copy_outside_its_region_is_a_bounds_error(plan: Plan) -> None:
    rp = next(r for r in plan.ranks if len(r.copies))
    c = rp.copies
    size = np.array(c["size0"])
    size[0] = 10**6
    assert verify.bounds(_edit(plan, rp.rank, copies=_rows(c, np.ones(len(c), bool),
                                                            size0=size))) != []
    assert any(r.name == STAGING for r in rp.regions)
