"""FP8 boxes QUANT reads in place (`gather_direct.py`): a round's values, then its scales.

An MoE's expert boxes of one staging round land in their owner's staging as every box's
e4m3 values in the order the targets take them, then every box's scales, so that the
writes of adjacent experts merge (apart, an MoE's small writes, two a box, kept the copy
kernel on the SMs beside the quantizer)."""

from __future__ import annotations

import json

import numpy as np

from planner.passes.gather_direct import values_first
from schemas.plan import QUANT
from schemas.protocol import staging_index
from tests.support.local_refit import refit_differs
from tests.support.synthetic import MOE_GATHER as MOE


def test_values_first_lays_each_round_out_as_values_then_scales():
    # boxes in allocation order: owner 0 round 0 (3 boxes), owner 1 round 0, owner 0 round 1
    owner = np.array([0, 0, 0, 1, 0])
    k = np.array([0, 0, 0, 0, 1])
    v = np.array([128, 64, 128, 64, 64])
    s = np.array([64, 64, 64, 64, 64])
    start = np.array([1000, 1192, 1320, 0, 0])  # each owner's bump allocation per round
    where = np.array([[0, 0, 0, 0, 0], [5, 5, 5, 5, 5], [300, 100, 200, 0, 0]])
    val, sc = values_first(owner, k, where, start, v, s)
    # owner 0 round 0 in target order 1, 2, 0: values 64 + 128 + 128, then scales
    assert val[[1, 2, 0]].tolist() == [1000, 1064, 1192]
    assert sc[[1, 2, 0]].tolist() == [1320, 1384, 1448]
    assert (val[3], sc[3], val[4], sc[4]) == (0, 64, 0, 64)
    # the same bytes as before, none shared
    for o, r in ((0, 0), (1, 0), (0, 1)):
        m = (owner == o) & (k == r)
        spans = sorted([(a, a + b) for a, b in zip(val[m], v[m])]
                       + [(a, a + b) for a, b in zip(sc[m], s[m])])
        assert spans[0][0] == start[m].min()
        assert spans[-1][1] == (start[m] + v[m] + s[m]).max()
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))


def test_moe_expert_writes_merge_and_stay_bit_exact(tmp_path):
    from harness.weights import quantize_full, random_full_tensors
    from planner.compiler import compile_config
    from planner.frameworks import build_layout
    from planner.spec import load_spec
    from planner.tools.verify import verify_plan
    from planner.validate import validate
    from schemas.config_load import config_from_dict
    from schemas.plan_write import write_plan

    (tmp_path / "config.json").write_text(json.dumps(MOE))
    cfg = config_from_dict({"model": {"config": "config.json"},
                            "source": dict(framework="megatron", tp=1),
                            "target": dict(engine="vllm", tp=1, dtype="fp8_block128"),
                            # a few expert boxes a round: several rounds per owner
                            "options": {"staging_bytes": 4 << 20}}, str(tmp_path))
    spec = load_spec(cfg.model_config_path)
    validate(cfg, spec)
    plan = compile_config(cfg, spec)
    assert verify_plan(plan) == []
    rp = plan.ranks[0]
    c = rp.copies
    quants = int((c["kind"] == QUANT).sum())
    rounds = len(np.unique(c["stage"][c["kind"] == QUANT]))
    assert quants >= 48 and rounds >= 4
    # every QUANT box of a round lands whole in the target: on main, two writes a box (the
    # fan-out: the writes that read staging; its QUANTs may run a stage before them)
    writes = int((rp.writes["src_region"] == staging_index(rp)).sum())
    # main: two writes a box (112 for 56 boxes); here the experts of a round merge (58)
    assert writes * 10 <= 2 * quants * 6, (writes, quants)
    path = str(tmp_path / "p.rplan")
    write_plan(path, plan)
    full = random_full_tensors(spec, seed=5)
    src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    assert refit_differs(path, src, dst, full, quantize_full(spec, full)) == []


def test_rounds_are_the_next_fit_of_place():
    """`_rounds` (an owner's round and level kept as ints) places boxes as `_place` and
    `Staging.take` do one by one: same offsets, rounds, staging table and peaks, staging
    already used before it included."""
    from types import SimpleNamespace

    from planner.passes.gather_direct import _rounds
    from planner.passes.gather_out import Staging
    from schemas.protocol import ALIGN

    rng = np.random.default_rng(1)
    owners = rng.integers(0, 4, 300).tolist()
    needs = (rng.integers(1, 40, 300) * ALIGN).tolist()
    base = 5

    def state():
        alloc = Staging(4, 200 * ALIGN)
        alloc.take(2, (base + 2, base + 3), 150 * ALIGN)  # rank 2's round 1 nearly full
        return SimpleNamespace(alloc=alloc, rounds={2: 1}, base=base)

    want, got = state(), state()
    starts, ks = [], []
    for o, need in zip(owners, needs):  # `Gatherer._place`
        k = want.rounds.get(o, 0)
        while not want.alloc.fits(o, (base + 2 * k, base + 2 * k + 1), need):
            k += 1
        want.rounds[o] = k
        starts.append(want.alloc.take(o, (base + 2 * k, base + 2 * k + 1), need))
        ks.append(k)
    s, k = _rounds(got, owners, needs)
    assert s.tolist() == starts and k.tolist() == ks and max(ks) > 2
    assert got.alloc.used == want.alloc.used and got.rounds == want.rounds
    assert got.alloc.peak0 == want.alloc.peak0
