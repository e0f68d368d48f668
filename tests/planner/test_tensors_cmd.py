"""`rdma-plan tensors` (schemas.tensors.rank_tensors): what a rank binds, as the layouts say."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from planner.cli import main
from planner.compiler import compile_config
from planner.frameworks import build_layout
from planner.spec import spec_from_hf
from planner.validate import validate
from schemas.config_load import config_from_dict
from schemas.errors import PlanFormatError
from schemas.plan import load_plan
from schemas.plan_write import encode_plan, write_plan
from schemas.tensors import rank_tensors
from tests.support.models import deepseek_v3

SOURCE = {"framework": "megatron", "tp": 2, "dp": 2, "ep": 2, "pp": 2}
TARGET = {"engine": "vllm", "tp": 2, "replicas": 2}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    spec = spec_from_hf(deepseek_v3(num_hidden_layers=4), mtp=False)
    cfg = config_from_dict({"model": {"config": "x"}, "source": SOURCE, "target": TARGET})
    validate(cfg, spec)
    path = str(tmp_path_factory.mktemp("t") / "p.rplan")
    write_plan(path, compile_config(cfg, spec))
    return path, cfg, spec


def _expected(pt) -> list[dict]:
    """The layout's pieces as `rdma-plan tensors` prints them (flat start, strides)."""
    strides = [math.prod(pt.shape[d + 1:]) for d in range(len(pt.shape))]
    out = []
    for p in pt.pieces:
        dims = p.phys_dims()
        out.append({"tensor": p.tensor, "offsets": list(p.offsets), "sizes": list(p.sizes),
                    "start": sum(a * s for a, s in zip(p.at, strides)),
                    "strides": [strides[d] for d in dims]})
    return out


def test_json_lists_every_rank_as_its_layout(compiled, capsys):
    path, cfg, spec = compiled
    layouts = [build_layout(spec, cfg.source), build_layout(spec, cfg.target)]
    ranks = [*layouts[0].ranks, *layouts[1].ranks]
    for rank, rl in enumerate(ranks):
        assert main(["tensors", path, "--rank", str(rank), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["rank"] == rank and got["role"] == ("source" if rank < 8 else "target")
        assert [(t["name"], tuple(t["shape"]), t["dtype"]) for t in got["tensors"]] == \
            [(t.name, t.shape, t.dtype) for t in rl.tensors]
        assert [t["pieces"] for t in got["tensors"]] == [_expected(t) for t in rl.tensors]
        kinds = {t["name"]: t["kind"] for t in got["tensors"]}
        if rank < 8:  # MoE layers on both stages: router.expert_bias is a buffer
            bias = [n for n in kinds if n.endswith("router.expert_bias")]
            assert bias and all(kinds[n] == "buffer" for n in bias)
            assert sum(k == "buffer" for k in kinds.values()) == len(bias)
        assert got["identity"]["framework"] == ("megatron" if rank < 8 else "vllm")


def test_text_table(compiled, capsys):
    path, _, _ = compiled
    assert main(["tensors", path, "--rank", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 5 (source): ") and "identity: framework=megatron tp=1 pp=1" in out
    line = next(x for x in out.splitlines() if "router.expert_bias" in x)
    assert " buffer " in line and "e_score_correction_bias [0:4]" in line


def test_bad_rank_and_old_plans_are_one_line(compiled, tmp_path, capsys):
    path, _, _ = compiled
    assert main(["tensors", path, "--rank", "99"]) == 2
    assert "plan has no rank 99" in capsys.readouterr().err
    plan = load_plan(path)
    old = str(tmp_path / "old.rplan")
    with open(old, "wb") as f:
        f.write(encode_plan(dataclasses.replace(plan, extra_blobs=())))
    with pytest.raises(PlanFormatError, match="older rdma-plan"):
        rank_tensors(old, 0)
    bad = str(tmp_path / "bad.rplan")
    blobs = tuple((n, {"same_as": 7} if n == "tensors/3" else b) for n, b in plan.extra_blobs)
    with open(bad, "wb") as f:
        f.write(encode_plan(dataclasses.replace(plan, extra_blobs=blobs)))
    assert main(["tensors", bad, "--rank", "3"]) == 2
    assert "tensors/3 refers to rank 7" in capsys.readouterr().err


def test_replicas_share_one_blob(compiled):
    path, _, _ = compiled
    plan = load_plan(path)
    blobs = dict(plan.extra_blobs)
    # TP 2 x EP 2 x PP 2 Megatron ranks all differ; the second vLLM replica repeats the first
    assert all("names" in blobs[f"tensors/{r}"] for r in range(8))
    assert blobs["tensors/10"] == {"same_as": 8} and blobs["tensors/11"] == {"same_as": 9}
    assert rank_tensors(path, 10).tensors == rank_tensors(path, 8).tensors


def test_holders_are_the_ranks_whose_pieces_name_the_tensor(compiled):
    """`holders` (explain's list, read as columns) against every source's decoded pieces,
    for every logical tensor and one the plan does not have."""
    from schemas.tensors import holders

    path, cfg, spec = compiled
    sources = range(load_plan(path).header.sources)
    pieces = {r: {p.tensor for t in rank_tensors(path, r).tensors for p in t.pieces}
              for r in sources}
    names = [t.name for t in spec.tensors] + ["model.no_such.weight"]
    for name in names:
        assert holders(path, name) == [r for r in sources if name in pieces[r]], name
    assert any(holders(path, n) for n in names) and not holders(path, names[-1])


def test_spilled_blobs_write_the_same_file(compiled, tmp_path):
    """`compile_config(spill=True)` (what `rdma-plan compile` runs): the tensors blobs' piece
    columns are memoryviews of a mapped file, and the plan file is the same bytes."""
    path, cfg, spec = compiled
    plan = compile_config(cfg, spec, spill=True)
    kept = [b for _, b in plan.extra_blobs if "pieces" in b]
    assert kept and all(isinstance(c, memoryview) and c.readonly
                        for b in kept for c in b["pieces"])
    assert encode_plan(plan) == open(path, "rb").read()
