"""The simulator on hand-built plans whose times are computed by hand, and on compiled
synthetic plans (estimated >= floor, floor computed here independently).

Units: a 400 Gb/s NIC moves 50 GB/s, so 1 GB takes 20 ms; NVLink at 3600 Gb/s moves
450 GB/s; packs at 2000 Gb/s move 250 GB/s. Signals take `write_overhead_us` to arrive.
"""

from __future__ import annotations

import dataclasses

import pytest

from planner.tools.simulate import simulate
from planner.topology import NIC_WRITE_S, NVLINK_WRITE_S
from schemas.plan import DONE, PACK, READY, SIGNAL_COLUMNS, UNPACK, Plan, RankPlan, Table
from tests.support.plans import GB, NIC_BPS, NV_BPS, plan_of, src, tgt


def test_one_gigabyte_over_one_nic():
    # source h0/gpu0 -> target h1/gpu0: 1 GB at 50 GB/s = 20 ms; one batch: 2 us of
    # latency and 16 writes x 10 ns of NIC work; READY and DONE each arrive 2 us after
    # they are sent.
    plan = plan_of([src(0, 0, (0, 0, 1, GB, 16)), tgt(1, 0)], overhead_us=2.0)
    res = simulate(plan)
    assert res["floor_s"] == pytest.approx(0.02)
    assert res["estimated_s"] == pytest.approx(2e-6 + 0.02 + 2e-6 + 16 * NIC_WRITE_S + 2e-6)
    assert res["bottleneck"] == "h0/nic0 egress"
    assert res["nics"][0]["bytes_out"] == GB and res["nics"][1]["bytes_in"] == GB


def test_two_sources_share_the_target_ingress():
    # h0 and h1 each send to the one target on h2: its NIC takes 1 GB at 50 GB/s = 20 ms.
    # Unequal halves (0.25 + 0.75 GB): 25 GB/s each until the small one ends at 10 ms, then
    # the big one alone at 50 GB/s for its last 0.5 GB: also 20 ms in all (max-min fair).
    for a, b in ((GB // 2, GB // 2), (GB // 4, 3 * GB // 4)):
        plan = plan_of([src(0, 0, (0, 0, 2, a, 1)), src(1, 0, (0, 0, 2, b, 1)), tgt(2, 0)])
        res = simulate(plan)
        assert res["floor_s"] == pytest.approx(0.02)
        assert res["estimated_s"] == pytest.approx(0.02)
        assert res["bottleneck"] == "h2/nic0 ingress"
    ends = sorted(res["timeline"]["end"].tolist())
    assert ends == pytest.approx([0.01, 0.02], abs=1e-7)  # + 10 ns per write (NIC_WRITE_S)


def test_gpus_behind_one_nic_share_its_egress():
    # 4 NICs per host: GPUs 0 and 1 share h0/nic0; they send 0.5 GB each to two targets on
    # different NICs of h1: the shared egress carries 1 GB: 20 ms.
    plan = plan_of([src(0, 0, (0, 0, 2, GB // 2, 1)), src(0, 1, (0, 0, 3, GB // 2, 1)),
                  tgt(1, 0), tgt(1, 2)], nics_per_host=4)
    res = simulate(plan)
    assert res["floor_s"] == pytest.approx(0.02)
    assert res["estimated_s"] == pytest.approx(0.02)


def test_same_host_writes_go_over_nvlink_alongside_the_nic():
    # 1 GB to a target on the same host over NVLink (450 GB/s: 2.22 ms, plus NVLINK_WRITE_S
    # for its one peer write) while 1 GB goes to another host over the NIC (20 ms): the two channels
    # run at once, the NIC dominates.
    plan = plan_of([src(0, 0, (0, 1, 1, GB, 1), (0, 0, 2, GB, 1)), tgt(0, 4), tgt(1, 0)])
    res = simulate(plan)
    assert res["estimated_s"] == pytest.approx(0.02, abs=1e-7)
    tl = res["timeline"]
    nv = tl["chan"] == 1
    assert tl["end"][nv][0] == pytest.approx(GB / NV_BPS + NVLINK_WRITE_S)
    assert res["nvlink_bytes"] == GB
    # NVLink alone: its own floor.
    res = simulate(plan_of([src(0, 0, (0, 1, 1, GB, 1)), tgt(0, 4)]))
    assert res["floor_s"] == pytest.approx(GB / NV_BPS)
    assert res["estimated_s"] == pytest.approx(GB / NV_BPS + NVLINK_WRITE_S)
    assert res["bottleneck"] == "rank 0 NVLink out"


def test_staged_plan_packs_writes_unpacks_and_acks():
    # Two stages of 1 GB each through staging, ACK-gated. Pack/unpack of 1 GB at 250 GB/s
    # = 4 ms + 10 us; writes 20 ms; signals 2 us.
    #   stage 0: READY 2 us | pack P | write W | DONE +2us | target unpacks U | ACK +2us
    #   stage 1: pack P | write W | DONE +2us | unpack U  (the end)
    lat, p, w = 2e-6, GB / 250e9 + 10e-6, GB / NIC_BPS
    plan = plan_of([src(0, 0, (0, 0, 1, GB, 1), (1, 0, 1, GB, 1),
                      copies=((PACK, 0, GB), (PACK, 1, GB))),
                  tgt(1, 0, copies=((UNPACK, 0, GB), (UNPACK, 1, GB)))],
                 overhead_us=0.0, pack_us=10.0, acks=True)
    header = dataclasses.replace(  # signals and batches: 2 us
        plan.header, options=dataclasses.replace(plan.header.options, write_overhead_us=2.0))
    res = simulate(dataclasses.replace(plan, header=header))
    w += lat + NIC_WRITE_S  # one batch of one write
    t_ack = lat + p + w + lat + p + lat
    assert res["estimated_s"] == pytest.approx(t_ack + p + w + lat + p)
    assert res["stages"] == 2
    assert res["ratio"] > 1.4  # packs and unpacks are not overlapped with writes


def test_a_wait_nobody_signals_is_an_error():
    plan = plan_of([src(0, 0, (0, 0, 1, GB, 1)), tgt(1, 0)])
    rp = plan.ranks[1]
    bad = RankPlan(**{**{f: getattr(rp, f) for f in RankPlan.__slots__},
                      "waits": Table.build(SIGNAL_COLUMNS, stage=[0, 0], peer=[0, 0],
                                           kind=[DONE, READY])})  # no source sends READY
    with pytest.raises(ValueError, match="never finish"):
        simulate(Plan(header=plan.header, ranks=(plan.ranks[0], bad)))


def _independent_floor(plan: Plan) -> float:
    """Most bytes through one NIC direction or one GPU's NVLink direction, over bandwidth."""
    nic = {r: row.nic for r, row in enumerate(plan.header.ranks)}
    load: dict[tuple[str, object], float] = {}
    for rp in plan.ranks:
        for _st, ch, a, b in zip(rp.batches["stage"], rp.batches["nic"], rp.batches["start"],
                                rp.batches["stop"]):
            for d, n in zip(rp.writes["dst_rank"][a:b], rp.writes["nbytes"][a:b]):
                keys = ((("out", nic[rp.rank]), ("in", nic[int(d)])) if ch == 0 else
                        (("nv-out", rp.rank), ("nv-in", int(d))))
                for k in keys:
                    load[k] = load.get(k, 0) + int(n)
    return max(v * 8 / ((plan.header.cluster.nic_gbps if k[0] in ("out", "in") else
                         plan.header.nvlink_gbps) * 1e9) for k, v in load.items())


@pytest.mark.parametrize("opts", [{}, {"staging_bytes": 8192, "max_write_bytes": 4096},
                                  {"write_overhead_us": 0.0}])
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_compiled_plans_never_beat_the_floor(opts, placement):
    from tests.support.synthetic import fsdp2_to_vllm_plan

    plan = fsdp2_to_vllm_plan(opts, placement)
    res = simulate(plan)
    floor = _independent_floor(plan)
    assert res["floor_s"] == pytest.approx(floor)
    assert res["floor_s"] == pytest.approx(plan.header.stats.floor_s)
    assert res["estimated_s"] >= res["floor_s"]
    tl = res["timeline"]
    assert (tl["end"] >= tl["start"]).all() and (tl["end"] <= res["estimated_s"] + 1e-12).all()
    assert res["bytes"] == plan.header.stats.bytes
    assert max(res["rank_finish_s"]) == res["estimated_s"]


def test_batches_in_flight_overlap_targets():
    # Source A (h0) sends 1 GB to T1 (h2) then 1 GB to T2 (h3); source B (h1) sends 1 GB to
    # T1. One batch at a time: A and B share T1's ingress (25 GB/s each, 40 ms), then A
    # sends to T2 alone (20 ms): 60 ms. Two in flight: A's egress carries 2 GB at 50 GB/s
    # and every flow gets 25 GB/s: all end at 40 ms, the floor (A's egress).
    plan = plan_of([src(0, 0, (0, 0, 2, GB, 1), (0, 0, 3, GB, 1)), src(1, 0, (0, 0, 2, GB, 1)),
                  tgt(2, 0), tgt(3, 0)])
    assert simulate(plan, inflight=1)["estimated_s"] == pytest.approx(0.06)
    res = simulate(plan, inflight=2)
    assert res["estimated_s"] == pytest.approx(0.04)
    assert res["floor_s"] == pytest.approx(0.04)


def test_a_landed_batch_frees_its_place_behind_a_slow_head():
    # X sends A (1 GB -> T1), B (0.1 GB -> T2), C (1 GB -> T3) with 2 in flight; D also
    # sends 1 GB -> T1, so A crawls at 25 GB/s. B lands at 4 ms and frees its place (were
    # the oldest batch reaped first, C would wait for A: 60 ms): C starts at 4 ms beside A
    # (25 GB/s each), has 0.1 GB left when A ends at 40 ms: 42 ms = the floor (X's egress
    # carries 2.1 GB).
    plan = plan_of([src(0, 0, (0, 0, 2, GB, 1), (0, 0, 3, GB // 10, 1), (0, 0, 4, GB, 1)),
                  src(1, 0, (0, 0, 2, GB, 1)), tgt(2, 0), tgt(3, 0), tgt(4, 0)])
    res = simulate(plan, inflight=2)
    assert res["estimated_s"] == pytest.approx(0.042)
    assert res["floor_s"] == pytest.approx(0.042)


@pytest.mark.parametrize("opts", [{}, {"staging_bytes": 8192, "max_write_bytes": 4096}])
def test_copy_seconds_count_one_op_per_distinct_group(opts):
    # a stage's copy seconds: bytes at the pack rate plus the overhead once per QUANT and
    # once per distinct group of PACKs (or UNPACKs), here counted the straightforward way
    # (`np.unique` of the rows of every column of the group key)
    import numpy as np

    from planner.tools.simflow import _copy_seconds
    from schemas.plan import COPY_GROUP_KEY, QUANT
    from schemas.protocol import ITEM
    from tests.support.synthetic import fsdp2_to_vllm_plan

    plan = fsdp2_to_vllm_plan(opts, "disaggregated")
    bps, ov, seen = 7e9, 3e-5, 0
    for rp in plan.ranks:
        c = rp.copies
        for kinds in ((PACK, QUANT), (UNPACK,)):
            m = np.isin(c["kind"], kinds)
            want = np.zeros(rp.stages)
            item = np.maximum(ITEM[c["src_dtype"][m]], ITEM[c["dst_dtype"][m]])
            nb = (c["size0"][m] * c["size1"][m] * c["size2"][m] * item).astype(np.float64)
            np.add.at(want, c["stage"][m], nb / bps)
            rows = np.flatnonzero(m)
            np.add.at(want, c["stage"][rows[c["kind"][rows] == QUANT]], ov)
            rows = rows[c["kind"][rows] != QUANT]
            if len(rows):
                key = np.stack([c[k][rows].astype(np.int64)
                                for k in ("stage", "kind", *COPY_GROUP_KEY)], axis=1)
                np.add.at(want, np.unique(key, axis=0)[:, 0], ov)
                seen += 1
            got = _copy_seconds(rp, kinds, bps, ov)
            assert got.tobytes() == want.tobytes(), (rp.rank, kinds)
    assert seen >= 2
