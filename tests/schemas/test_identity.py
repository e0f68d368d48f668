"""Rank identities: the format (schemas/identity.py), the compiler's `identities` header key,
and `executor.load(identity=...)` refusing a swapped rank before anything is registered."""

from __future__ import annotations

import pytest

from planner.compiler import compile_config
from planner.layouts import fsdp2, megatron, sglang, vllm
from planner.spec import spec_from_hf
from planner.validate import validate
from schemas.config import SourceConfig, TargetConfig
from schemas.config_load import config_from_dict
from schemas.errors import IdentityError
from schemas.identity import (
    check_against_plan,
    check_identities,
    check_identity,
    describe,
    find_rank,
)
from schemas.plan import read_header
from schemas.plan_write import write_plan
from tests.support.models import qwen3

MEGA = {"framework": "megatron", "tp": 0, "pp": 0, "vpp": 1, "dp": 0, "ep": 0, "etp": 0,
        "edp": 0}


@pytest.mark.parametrize("bad, message", [
    ([1, 2], "list is not an identity"),
    ({"framework": "torch"}, "identity.framework: 'torch' is not one of"),
    ({**MEGA, "cp": 0}, "unknown ['cp']"),
    ({k: v for k, v in MEGA.items() if k != "edp"}, "missing ['edp']"),
    ({**MEGA, "tp": -1}, "identity.tp: -1 must be an integer >= 0"),
    ({**MEGA, "tp": True}, "identity.tp: True must be an integer"),
    ({**MEGA, "vpp": 0}, "identity.vpp: 0 must be an integer >= 1"),
    ({**MEGA, "pp": "1"}, "identity.pp: '1' must be an integer"),
])
def test_bad_identities_are_named(bad, message):
    with pytest.raises(IdentityError) as e:
        check_identity(bad)
    assert message in str(e.value)


def test_header_identities_are_checked():
    vl = {"framework": "vllm", "replica": 0, "dp": 0, "tp": 0, "pp": 0, "ep": 0}
    assert check_identities([MEGA, vl], 2, 1) == [MEGA, vl]
    with pytest.raises(IdentityError, match="must list 3 identities"):
        check_identities([MEGA, vl], 3, 1)
    with pytest.raises(IdentityError, match="framework 'vllm' on a source rank"):
        check_identities([vl, MEGA], 2, 1)
    with pytest.raises(IdentityError, match="ranks 0 and 1 have the same identity"):
        check_identities([MEGA, MEGA, vl], 3, 2)


def test_layout_identities_are_distinct_and_follow_the_grids():
    # Megatron: dense grid tp-dp-pp, expert grid etp-ep-edp-pp (TP 2, DP 2, EP 2, ETP 1)
    cfg = SourceConfig(framework="megatron", tp=2, dp=2, pp=2, ep=2, etp=1, vpp=2)
    ids = [megatron.identity(cfg, r) for r in range(cfg.world)]
    assert ids[5] == {"framework": "megatron", "tp": 1, "pp": 1, "vpp": 2, "dp": 0, "ep": 1,
                      "etp": 0, "edp": 0}
    assert ids[3]["edp"] == 1 and ids[3]["ep"] == 1 and ids[3]["dp"] == 1
    hsdp = SourceConfig(framework="fsdp2", dp=2, dp_replicate=2, tp=2)
    assert fsdp2.identity(hsdp, 6) == {"framework": "fsdp2", "dp_replicate": 1,
                                       "dp_shard": 1, "tp": 0}
    eng = TargetConfig(engine="vllm", tp=2, dp=2, pp=2, ep=True, replicas=2)
    assert vllm.identity(eng, 8 + 5) == {"framework": "vllm", "replica": 1, "dp": 1, "tp": 1,
                                         "pp": 0, "ep": 3}
    sg = TargetConfig(engine="sglang", tp=4, dp=2, dp_attention=True)
    assert [sglang.identity(sg, r)["attn_tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [sglang.identity(sg, r)["dp"] for r in range(4)] == [0, 0, 1, 1]
    for side, fn, world in ((cfg, megatron.identity, cfg.world),
                            (hsdp, fsdp2.identity, hsdp.world), (eng, vllm.identity, eng.world),
                            (sg, sglang.identity, sg.world)):
        seen = [tuple(sorted(fn(side, r).items())) for r in range(world)]
        assert len(set(seen)) == world


def _plan(tmp_path, source: dict, target: dict) -> str:
    hf = qwen3()
    cfg = config_from_dict({"model": {"config": "x"}, "source": source, "target": target})
    spec = spec_from_hf(hf)
    validate(cfg, spec)
    path = str(tmp_path / "p.rplan")
    write_plan(path, compile_config(cfg, spec))
    return path


def test_swapped_megatron_tp_ranks_are_refused_before_registration(tmp_path):
    # the report: swapping the two Megatron TP source ranks bound, ran and returned
    # complete=True with wrong target weights. Equal shapes; only the identity tells them apart.
    import executor

    path = _plan(tmp_path, {"framework": "megatron", "tp": 2}, {"engine": "vllm", "tp": 1})
    with open(path, "rb") as f:
        header, _ = read_header(f)
    ids = header.identities
    assert ids[0]["tp"] == 0 and ids[1]["tp"] == 1 and ids[2]["framework"] == "vllm"
    check_against_plan(header, 1, ids[1])  # the right one passes
    with pytest.raises(IdentityError) as e:
        # no rendezvous: a load that got past the identity check would fail on that instead
        executor.load(path, rank=1, tensors={}, identity=ids[0], transport="nixl")
    msg = str(e.value)
    assert describe(ids[0]) in msg and describe(ids[1]) in msg
    assert "that identity is plan rank 0" in msg and "\n" not in msg
    assert find_rank(header, ids[1]) == 1
    with pytest.raises(IdentityError, match="no source rank has the identity"):
        find_rank(header, {**ids[0], "tp": 2})


def test_plan_without_identities_refuses_a_given_identity(tmp_path):
    from planner.compiler import compile_layouts
    from tests.support.synthetic import fused_col_split, row_split

    spec = spec_from_hf(qwen3())
    cfg = config_from_dict({"model": {"config": "x"}, "source": {"framework": "fsdp2",
                            "dp": 3}, "target": {"engine": "vllm", "tp": 2}})
    plan = compile_layouts(cfg, spec, row_split(spec, 3), fused_col_split(spec, 2, 1))
    assert not plan.header.identities
    with pytest.raises(IdentityError, match="records no rank identities"):
        check_against_plan(plan.header, 0, MEGA)
    check_against_plan(plan.header, 0, None)  # no identity given: nothing to check


def test_inspect_ranks_prints_every_identity(tmp_path, capsys):
    from planner.cli import main

    path = _plan(tmp_path, {"framework": "fsdp2", "dp": 2}, {"engine": "sglang", "tp": 2})
    assert main(["inspect", path, "--ranks"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5  # the head and 4 ranks
    head = out[0].split()
    rows = [dict(zip(head, line.split())) for line in out[1:]]
    assert rows[1] == {**rows[1], "role": "source", "framework": "fsdp2", "dp_shard": "1"}
    assert rows[3] == {**rows[3], "role": "target", "framework": "sglang", "tp": "1",
                       "attn_tp": "1", "replica": "0"}
