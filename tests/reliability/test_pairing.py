"""Wrong pairing: a plan compiled for another model or layout is refused at bind with the
list of mismatches; ranks holding plans with different fingerprints refuse each other at
connect (NIXL, separate processes), naming the peer."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from executor import BindError, Executor
from executor.transports.local import Fabric
from harness.world import ROOT, World
from schemas.plan import load_rank

DEMO = os.path.join(ROOT, "plans", "demo.yaml")


def _variant(tmp_path, name: str, **edits) -> str:
    with open(DEMO) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["config"] = os.path.join(ROOT, "plans", cfg["model"]["config"])
    for path, value in edits.items():
        section, key = path.split(".")
        cfg[section][key] = value
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return str(out)


def _compile(config: str, out: str) -> str:
    from planner.compiler import compile_file

    compile_file(config, out)
    return out


def _tensors(config: str, rank: int) -> dict[str, torch.Tensor]:
    from planner.frameworks import build_layout
    from planner.validate import load

    cfg, spec = load(config)
    src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    layout, local = (src, rank) if rank < src.world else (dst, rank - src.world)
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    return {t.name: torch.zeros(t.shape, dtype=dt[t.dtype]) for t in layout.ranks[local].tensors}


@pytest.mark.parametrize("edits, rank, expect", [
    # tensors of a 4-layer model, a plan for 8 layers: layers 4-7 are missing
    ({"model.num_layers": 8}, 2, [r"tensor\(s\) do not match the plan",
                                  r"layers\.[4-7]\..*: missing \(the plan expects"]),
    # the same model, the targets in TP 2 instead of TP 1: every sharded tensor differs
    ({"target.tp": 2, "target.replicas": 1}, 2,
     [r"tensor\(s\) do not match the plan", r"shape \[\d+(, \d+)*\] != plan"]),
    # another model (wider MLP) on the source side
    ({"model.overrides": {"intermediate_size": 1024}}, 0,
     [r"mlp\.linear_fc1\.weight: shape \[512, 256\] != plan \[1024, 256\]"]),
])
def test_plan_for_another_model_or_layout_is_refused_at_bind(tmp_path, edits, rank, expect):
    import re

    other = _compile(_variant(tmp_path, "other", **edits), str(tmp_path / "other.rplan"))
    header, rp = load_rank(other, rank)
    fabric = Fabric()
    with pytest.raises(BindError) as e:
        Executor(header, rp, _tensors(DEMO, rank), transport="local", rendezvous=fabric)
    msg = str(e.value)
    for pattern in expect:
        assert re.search(pattern, msg), msg
    n = int(msg.split(": ", 1)[1].split(" ")[0])
    assert n >= 2 and len(msg.splitlines()) == n + 1  # every mismatch listed, one per line
    assert not fabric.kv  # nothing registered, nothing published


def test_ranks_with_different_plans_refuse_each_other_at_connect(tmp_path):
    pytest.importorskip("nixl")
    demo = _compile(DEMO, str(tmp_path / "demo.rplan"))
    other_cfg = _variant(tmp_path, "other", **{"model.num_layers": 2})
    other = _compile(other_cfg, str(tmp_path / "other.rplan"))
    w = World(DEMO, demo, 4, steps=0, plans={2: (other_cfg, other)})
    try:
        for r in range(4):
            w.spawn(r)
        got = {r: w.loaded(r) for r in range(4)}
    finally:
        w.close()
    for r in (0, 1):  # the sources write into rank 2: they check it and refuse it
        assert got[r]["error"] == "PeerMismatchError" and got[r]["peer"] == 2, got[r]
        assert f"rank {r}: peer rank 2 loaded plan" in got[r]["msg"], got[r]
    assert got[2]["error"] == "PeerMismatchError" and got[2]["peer"] in (0, 1), got[2]
    assert "load the same plan on every rank" in got[2]["msg"]
    assert "error" not in got[3], got[3]  # rank 3 and its peers agree
