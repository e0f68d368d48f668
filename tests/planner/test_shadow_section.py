"""The plan's shadow section (`target.shadow`, `schemas/shadow.py`): compiled only when
asked, verified like every other op (`rdma-plan verify`'s `shadow` check), refused at load
by the executor's checks when it breaks a rule, and absent (plans byte-identical) without."""

from __future__ import annotations

import dataclasses
import resource

import numpy as np
import pytest

from planner.passes.shadow import layer_of
from planner.tools.verify import verify_plan
from schemas.config import ConfigError
from schemas.config_load import config_from_dict
from schemas.plan import RankPlan
from schemas.plan_write import encode_plan
from schemas.rankcheck import rank_violations
from schemas.shadow import SWITCH_COLUMNS, ShadowPart
from schemas.table import Table
from tests.support.clock import cpu_seconds
from tests.support.shadow_plans import CASES, _broken, _compile


def _part(rp: RankPlan) -> dict:
    enc = rp.encode()
    enc.pop("shadow", None)
    return enc


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_full_section_states_exactly_the_written_bytes_and_leaves_the_rest(case):
    plain, full = _compile(case), _compile(case, "full")
    assert verify_plan(full) == []
    assert all(rp.shadow is None for rp in plain.ranks)
    assert encode_plan(_compile(case, "full")) == encode_plan(full)  # deterministic
    assert "shadow" not in plain.header.encode()["target"]
    assert full.header.encode()["target"]["shadow"] == "full"
    cov = full.coverage
    for a, b in zip(plain.ranks, full.ranks, strict=True):
        assert _part(a) == _part(b)  # the ops, signals, regions: untouched
        if b.role == "source":
            assert b.shadow is None
            continue
        sh = b.shadow
        assert sh is not None and sh.budget == 0 and sh.chunks >= 2
        # what the section says is written is what the compiler's coverage table holds
        logical = int(cov["nbytes"][cov["rank"] == b.rank].sum())
        assert sh.written_bytes == logical > 0
        assert int(sh.switch["nbytes"].sum()) == logical
        assert (sh.switch["shadow_offset"] == sh.switch["offset"]).all()
        names = [b.regions[r].name for r in sh.switch["region"].tolist()]
        layers = [layer_of(n) for n in names]
        assert layers == sorted(layers)  # layer by layer
        # one chunk per layer
        assert sh.chunks == len(set(layers))
        assert not list(rank_violations(b, full.header))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_chunk_plans_fit_the_budget_in_layer_order(case):
    """A chunked shadow compiles to chunk plans (the same step as `rdma-plan compile`): each
    verifies, each target section is one chunk inside the budget, its ops sharing no byte of
    the buffer, and the chunks take the layers in order."""
    budget = 1 << 20
    plans = _compile(case, {"budget_bytes": budget})
    assert isinstance(plans, list) and len(plans) > 1
    last_layer = -1
    for plan in plans:
        assert verify_plan(plan) == []
        assert "shadow" not in plan.header.encode()["target"]  # a chunk is a plain plan
        layers = set()
        for rp in plan.ranks:
            if rp.role != "target":
                continue
            sh = rp.shadow
            s = sh.switch
            assert sh.budget == budget and sh.chunks == 1 and 0 < sh.budget_used <= budget
            end = s["shadow_offset"] + s["nbytes"]
            assert int(end.max()) <= budget
            o = np.argsort(s["shadow_offset"])  # the chunk's ops share no byte of the buffer
            assert (s["shadow_offset"][o][1:] >= end[o][:-1]).all()
            assert int(s["nbytes"].sum()) == sh.written_bytes
            layers |= {layer_of(rp.regions[r].name) for r in s["region"].tolist()}
        assert min(layers) >= last_layer  # layer by layer
        last_layer = max(layers)


def test_a_broken_switch_is_refused_by_the_loaders_check_and_by_verify():
    plan = _compile(CASES[0], "full")
    t = next(rp for rp in plan.ranks if rp.role == "target")
    src = next(rp for rp in plan.ranks if rp.role == "source")
    for what, bad in _broken(t).items():
        if what == "on a source":
            bad = dataclasses.replace(src, shadow=t.shadow)
        msgs = list(rank_violations(bad, plan.header))
        assert msgs and "shadow" in msgs[0], what
        ranks = tuple(bad if r.rank == bad.rank else r for r in plan.ranks)
        assert any("shadow" in m for m in verify_plan(dataclasses.replace(plan, ranks=ranks))), \
            what


def test_regions_that_miss_a_written_byte_are_caught_by_verify_alone():
    # a section consistent in itself (switch == regions) that leaves out one run the peers
    # write: only the cross-rank check sees it
    plan = _compile(CASES[0], "full")
    t = next(rp for rp in plan.ranks if rp.role == "target")
    sh = t.shadow
    keep = sh.switch["offset"] != sh.regions["offset"][0]
    keep |= sh.switch["region"] != sh.regions["region"][0]
    g = sh.regions
    part = ShadowPart(0, Table.build(g.schema, **{n: g[n][1:] for n, _ in g.schema}),
                      Table.build(SWITCH_COLUMNS, **{n: sh.switch[n][keep]
                                                      for n, _ in SWITCH_COLUMNS}))
    bad = dataclasses.replace(t, shadow=part)
    assert not list(rank_violations(bad, plan.header))
    ranks = tuple(bad if r.rank == t.rank else r for r in plan.ranks)
    msgs = verify_plan(dataclasses.replace(plan, ranks=ranks))
    assert any("not the bytes the plan writes" in m for m in msgs), msgs


@pytest.mark.parametrize("value,words", [
    ("half", "target.shadow: 'half' is not supported"),
    ({"budget": 1}, "target.shadow:"),
    ({"budget_bytes": 100}, "target.shadow.budget_bytes: 100 must be"),
    ({"budget_bytes": True}, "target.shadow.budget_bytes: True must be"),
])
def test_a_bad_shadow_key_is_one_line_naming_it(value, words):
    t0, rss = cpu_seconds(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"config": "x/config.json"}, "source": {"framework": "fsdp2"},
                          "target": {"engine": "vllm", "shadow": value}})
    assert str(e.value).startswith(words) and "\n" not in str(e.value)
    assert cpu_seconds() - t0 < 1  # refused cheaply: CPU seconds, not wall time
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100_000
