"""Plans that follow an expert placement (EPLB): layout, header, replan, refusals.

The placement (`target.placement`) names the logical expert of every physical slot; a plan
compiled for it must write every replica (checked by running the plan locally and comparing
each slot with the logical expert's own weights, not with the layout's materialization), and
a replan for a new placement must be the bytes a full compile of it gives.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from harness.weights import random_full_tensors
from planner.compiler import compile_config
from planner.errors import NotIncremental
from planner.frameworks import build_layout
from planner.layouts.vllm_rank import eplb_layers
from planner.replan import replan
from planner.spec import load_spec
from planner.tools.verify import verify_plan
from planner.validate import validate
from schemas.config import ConfigError
from schemas.config_load import config_from_dict
from schemas.errors import PlanFormatError
from schemas.header import PlanHeader
from schemas.placement import Placement, load
from schemas.plan_write import encode_plan, write_plan
from tests.support.local_refit import world_tensors

MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "plans", "models")
MOE, MLA = "tiny-qwen3-moe", "tiny-deepseek-v3"


def _cfg(model: str, source: dict, target: dict, table=None, options=None):
    target = dict(target)
    if table is not None:
        target["placement"] = {"physical_to_logical_map": table if isinstance(table, list)
                               else np.asarray(table).tolist()}
    cfg = config_from_dict({"model": {"config": f"{model}/config.json"}, "source": source,
                            "target": target, "cluster": {"gpus_per_host": 8},
                            "options": options or {}}, base_dir=MODELS)
    spec = load_spec(cfg.model_config_path)
    validate(cfg, spec)
    return cfg, spec


def _random_table(spec, slots: int, seed: int) -> np.ndarray:
    """Every logical expert once, the rest hot experts again, shuffled per layer."""
    d, rng = spec.dims, np.random.default_rng(seed)
    rows = []
    for _ in eplb_layers(d):
        extra = rng.choice(d.num_experts, slots - d.num_experts)
        rows.append(rng.permutation(np.concatenate([np.arange(d.num_experts), extra])))
    return np.array(rows)


def _slot_weights(spec, full, layer: int, expert: int, w13_order: str = "w1w3"):
    g, u, dn = (f"model.layers.{layer}.mlp.experts.{expert}.{w}.weight"
                for w in spec.dims.expert_names)
    return torch.cat([full[g], full[u]]), full[dn]


CASES = [  # model, source, target, physical slots
    (MOE, dict(framework="fsdp2", dp=2), dict(engine="vllm", tp=2, ep=True), 10),
    (MOE, dict(framework="fsdp2", dp=2), dict(engine="vllm", tp=2, dp=2, ep=True), 12),
    (MOE, dict(framework="fsdp2", dp=3), dict(engine="vllm", tp=1, dp=2, ep=True), 12),
    (MOE, dict(framework="megatron", tp=2, ep=2, dp=2), dict(engine="vllm", tp=2, ep=True), 10),
    (MOE, dict(framework="fsdp2", dp=2), dict(engine="sglang", tp=2, ep=True), 12),
    (MLA, dict(framework="fsdp2", dp=2), dict(engine="vllm", tp=2, ep=True), 12),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]['framework']}-"
                         f"{c[2]['engine']}-tp{c[2]['tp']}-dp{c[2].get('dp', 1)}-P{c[3]}")
def test_every_physical_replica_is_written(case, tmp_path):
    import executor

    model, source, target, slots = case
    _, spec = _cfg(model, source, target)
    table = _random_table(spec, slots, seed=3)
    cfg, spec = _cfg(model, source, target, table)
    plan = compile_config(cfg, spec)
    assert verify_plan(plan) == []
    assert plan.header.placement == Placement(table)
    path = str(tmp_path / "p.rplan")
    write_plan(path, plan)
    full = random_full_tensors(spec, seed=11)
    src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
    tensors = world_tensors(src, dst, full)
    executor.run_all_local(path, tensors)
    ep = cfg.target.tp * (cfg.target.dp if target["engine"] == "vllm" else 1)
    per = slots // ep
    written = 0
    for r in range(dst.world):
        got = tensors[src.world + r]
        ep_rank = plan.header.identities[src.world + r]["ep" if target["engine"] == "vllm"
                                                        else "tp"]
        for m, layer in enumerate(eplb_layers(spec.dims)):
            w13 = next(v for k, v in got.items()
                       if k.startswith(f"model.layers.{layer}.") and k.endswith("w13_weight"))
            w2 = next(v for k, v in got.items()
                      if k.startswith(f"model.layers.{layer}.") and k.endswith("w2_weight"))
            assert w13.shape[0] == per
            for j in range(per):
                e = int(table[m, ep_rank * per + j])
                want13, want2 = _slot_weights(spec, full, layer, e)
                assert torch.equal(w13[j], want13.to(w13.dtype)), (r, layer, j, e)
                assert torch.equal(w2[j], want2.to(w2.dtype)), (r, layer, j, e)
                written += 1
    assert written == slots * len(eplb_layers(spec.dims)) * (dst.world // ep)


REPLAN = [c for c in CASES if c[1]["framework"] == "fsdp2"]
DIRECT = {"write_overhead_us": 0.0}
"""Writes cost no more than their bytes: every expert slot is written directly (else a box
held by several replicas may be gathered on one rank first, and which ones depends on the
placement: `route`'s fine-cut boxes)."""


@pytest.mark.parametrize("case", REPLAN, ids=lambda c: f"{c[0]}-{c[2]['engine']}-P{c[3]}")
@pytest.mark.parametrize("seed,merge", [(1, "spans"), (2, "every")])
def test_replan_is_the_full_compile(case, seed, merge, monkeypatch):
    """(`merge`: a rank's moved writes put back by the spans they cross, or by one merge
    of every write: `replan_writes._DENSE`, whichever share of its writes moves.)"""
    from planner import replan_writes

    monkeypatch.setattr(replan_writes, "_DENSE", 0 if merge == "spans" else 1 << 40)
    model, source, target, slots = case
    _, spec = _cfg(model, source, target)
    a = _random_table(spec, slots, seed=seed)
    plan_a = compile_config(*_cfg(model, source, target, a, DIRECT))
    b = a.copy()
    b[0] = np.roll(b[0], 1)  # layer 0: every slot moves
    b[-1, :2] = b[-1, 1::-1] if b[-1, 0] != b[-1, 1] else b[-1, :2]
    b[-1, -1] = b[-1, -2]  # adjacent replicas on one rank (if that expert stays elsewhere)
    if np.bincount(b[-1], minlength=spec.dims.num_experts).min() == 0:
        b[-1] = a[-1]
    cfg_b, spec_b = _cfg(model, source, target, b, DIRECT)
    full_b = encode_plan(compile_config(cfg_b, spec_b))
    got = replan(plan_a, spec, Placement(b))
    assert encode_plan(got) == full_b
    assert got.header.fingerprint != plan_a.header.fingerprint
    # no memory registered again: every rank binds the same regions, writes the same peers
    for ra, rb in zip(plan_a.ranks, got.ranks):
        assert ra.regions == rb.regions and ra.peer_regions == rb.peer_regions
    # only writes into moved slots changed
    moved = Placement(a).moved(Placement(b))
    assert len(moved)
    back = replan(got, spec, Placement(a))
    assert encode_plan(back) == encode_plan(plan_a)


@pytest.mark.parametrize("case", REPLAN[:3:2] + REPLAN[-1:],
                         ids=lambda c: f"{c[0]}-{c[2]['engine']}-P{c[3]}")
@pytest.mark.parametrize("path", ["sorted", "merged"])
def test_replan_explain_rows_sorted_or_merged_are_the_full_compile(case, path, monkeypatch):
    """The explain rows made again another way than in order: sorted (as where the source
    ranks feeding a weight differ from tensor to tensor), or merged with the tensors' other
    rows (as where an expert also feeds another tensor): the same bytes."""
    from planner import replan_explain

    shape = replan_explain._shape

    def other_way(*args, **kwargs):
        srcs, n_src, other = shape(*args, **kwargs)
        return (None, n_src, other) if path == "sorted" else (srcs, n_src, True)

    monkeypatch.setattr(replan_explain, "_shape", other_way)
    monkeypatch.setattr(replan_explain, "_KEPT", [])
    model, source, target, slots = case
    _, spec = _cfg(model, source, target)
    a = _random_table(spec, slots, seed=3)
    plan_a = compile_config(*_cfg(model, source, target, a, DIRECT))
    b = a.copy()
    b[0] = np.roll(b[0], 1)
    b[-1, -1] = b[-1, -2]
    if np.bincount(b[-1], minlength=spec.dims.num_experts).min() == 0:
        b[-1] = a[-1]
    got = replan(plan_a, spec, Placement(b))
    assert encode_plan(got) == encode_plan(compile_config(*_cfg(model, source, target, b,
                                                                DIRECT)))
    assert encode_plan(replan(got, spec, Placement(a))) == encode_plan(plan_a)


def test_replan_refuses_gathered_experts():
    model, source, target, slots = CASES[0]
    _, spec = _cfg(model, source, target)
    a = _random_table(spec, slots, seed=2)  # expert 4 thrice in layer 3: gathered
    plan = compile_config(*_cfg(model, source, target, a))
    assert plan.header.stats.packs
    b = a.copy()
    b[3] = np.roll(b[3], 1)
    with pytest.raises(NotIncremental, match="through staging.*compile the new placement"):
        replan(plan, spec, Placement(b))


def test_replan_refuses_experts_on_ep_ranks():
    model, source, target, slots = CASES[2]
    _, spec = _cfg(model, source, target)
    a = _random_table(spec, slots, seed=5)
    plan = compile_config(*_cfg(model, source, target, a))
    b = a.copy()
    b[0] = np.roll(b[0], 3)
    with pytest.raises(NotIncremental) as e:
        replan(plan, spec, Placement(b))
    assert "compile the new placement in full" in str(e.value)
    assert "\n" not in str(e.value)


def test_replan_refuses_megatron_ep_sources_saying_why():
    model, source, target, slots = CASES[3]  # Megatron EP 2: each rank holds half the experts
    _, spec = _cfg(model, source, target)
    a = _random_table(spec, slots, seed=1)
    plan = compile_config(*_cfg(model, source, target, a, DIRECT))
    b = a.copy()
    b[0] = np.roll(b[0], 1)
    with pytest.raises(NotIncremental) as e:
        replan(plan, spec, Placement(b))
    line = str(e.value)
    pairs = len(eplb_layers(spec.dims)) * spec.dims.num_experts
    assert "\n" not in line and f"source rank 0 holds {pairs // 2} of the {pairs} " in line
    assert "experts on EP ranks" in line and "assign" in line
    assert line.endswith("compile the new placement in full")


def _layer0_moved() -> tuple:
    """(spec, slots, the plan compiled for a random placement `a`, `a`, `b`: `a` with every
    slot of MoE layer 0 moved) for the replan refusal tests."""
    model, source, target, slots = CASES[0]
    _, spec = _cfg(model, source, target)
    a = _random_table(spec, slots, seed=1)
    plan = compile_config(*_cfg(model, source, target, a, DIRECT))
    b = a.copy()
    b[0] = np.roll(b[0], 1)
    return spec, slots, plan, a, b


def _refused(plan, tampered, spec, b) -> str:
    """The one line `replan` refuses `tampered` with, once the untouched `plan` replans."""
    replan(plan, spec, Placement(b))
    with pytest.raises(NotIncremental) as e:
        replan(tampered, spec, Placement(b))
    return str(e.value)


@pytest.mark.parametrize("many", [False, True])
def test_replan_refuses_an_expert_piece_cut_unlike_its_layers_others(many, monkeypatch):
    """A source rank holding one expert's piece at another cut than the other experts of
    its MoE layer and weight (a plan not made so, or edited) is refused before any write
    reads it: whether its pieces are compared pair by pair (few moved writes) or every
    expert of the rank checked alike first (many)."""
    from planner import replan_tables
    from schemas.table import Table
    from schemas.tensors import PIECE_COLUMNS

    spec, slots, plan, a, b = _layer0_moved()
    blobs = dict(plan.extra_blobs)
    blob = dict(blobs["tensors/0"])
    t = Table.from_msgpack(PIECE_COLUMNS, blob["pieces"], "tensors/0")
    name = f"model.layers.0.mlp.experts.{int(b[0, 0])}.{spec.dims.expert_names[0]}.weight"
    row = int(np.flatnonzero(t["tensor"] == blob["names"].index(name))[0])
    cols = {c: np.array(t[c]) for c, _ in PIECE_COLUMNS}
    cols["stride0"][row] += 1  # the same bytes, read with another stride
    blob["pieces"] = Table.build(PIECE_COLUMNS, **cols).to_msgpack()
    tampered = dataclasses.replace(plan, extra_blobs=tuple(
        (n, blob if n == "tensors/0" else v) for n, v in plan.extra_blobs))
    monkeypatch.setattr(replan_tables.SourceTensors, "_MANY", 0 if many else np.inf)
    line = _refused(plan, tampered, spec, b)
    assert "\n" not in line and line.startswith("replan: source rank 0 ")
    assert "same cut" in line and line.endswith("compile the new placement in full")


def test_replan_refuses_explain_rows_of_a_moved_expert_fed_unevenly():
    """The explain rows a replan makes again come from what one slot is fed, read from the
    rows of the experts made again: one of those rows edited (its bytes no longer a share
    of the slot that the expert's other rows and the tensor's slots agree on) is refused in
    one line, and the untouched plan replans."""
    from schemas.plan import EXPLAIN_COLUMNS
    from schemas.table import Table

    spec, slots, plan, a, b = _layer0_moved()
    ranks = plan.header.targets  # (EP over every target rank: tp 2)
    per = slots // ranks
    n = spec.dims.num_experts
    counts = [np.stack([np.bincount(t[0, r * per:(r + 1) * per], minlength=n)
                        for r in range(ranks)]) for t in (a, b)]
    moved = np.flatnonzero((counts[0] != counts[1]).any(0))  # experts whose rows change
    assert len(moved)
    name = f"model.layers.0.mlp.experts.{int(moved[0])}.{spec.dims.expert_names[0]}.weight"
    t = plan.explain["tensor"]
    row = int(np.flatnonzero(t == plan.tensors.index(name))[0])
    cols = {c: np.array(plan.explain[c]) for c, _ in EXPLAIN_COLUMNS}
    cols["nbytes"][row] += 1
    tampered = dataclasses.replace(plan, explain=Table.build(EXPLAIN_COLUMNS, **cols))
    line = _refused(plan, tampered, spec, b)
    assert "\n" not in line and line.startswith("replan: ")
    assert "fed" in line and line.endswith("compile the new placement in full")


def test_expert_ids_packed_are_the_ids():
    """`ExpertIds.packed` (a spec id's (MoE layer * experts + expert) << wbits | weight) and
    `of_packed` (back to the id) agree with `ids` for every expert tensor, and are -1 for
    every other tensor and every packed id no tensor has."""
    from planner.placement import ExpertIds

    model, source, target, _ = CASES[0]
    _, spec = _cfg(model, source, target)
    ids = ExpertIds.of(spec)
    layers, experts, weights = ids.ids.shape
    assert 1 << ids.wbits >= weights
    ll, ee, ww = np.nonzero(ids.ids >= 0)
    got = ids.ids[ll, ee, ww]
    assert len(got) == layers * experts * weights  # (every expert of the tiny model named)
    p = (ll * experts + ee) << ids.wbits | ww
    assert (ids.packed[got] == p).all() and (ids.of_packed[p] == got).all()
    assert (ids.packed[ids.layer < 0] == -1).all()
    assert np.count_nonzero(ids.of_packed >= 0) == len(got)


def test_replan_refuses_another_slot_count():
    model, source, target, slots = CASES[0]
    _, spec = _cfg(model, source, target)
    plan = compile_config(*_cfg(model, source, target, _random_table(spec, slots, 1)))
    with pytest.raises(ConfigError, match="slot count changed"):
        replan(plan, spec, Placement(_random_table(spec, slots + 2, 1)))


def test_header_records_the_placement_and_refuses_a_forged_one():
    model, source, target, slots = CASES[0]
    _, spec = _cfg(model, source, target)
    table = _random_table(spec, slots, 4)
    cfg, spec = _cfg(model, source, target, table)
    plan = compile_config(cfg, spec)
    raw = plan.header.encode()
    assert raw["placement"]["digest"] == Placement(table).digest()
    assert "placement" not in raw["target"]
    back = PlanHeader.decode(raw)
    assert back.placement == Placement(table) and back.placement_base
    forged = copy.deepcopy(raw)
    t = np.frombuffer(forged["placement"]["table"], "<i4").copy()
    t[0], t[1] = t[1], t[0]
    forged["placement"]["table"] = t.tobytes()
    if t[0] != t[1]:
        with pytest.raises(PlanFormatError, match="placement digest"):
            PlanHeader.decode(forged)
    # without a placement the plan has no such key (older plans keep their bytes)
    cfg0, spec0 = _cfg(model, source, target)
    assert "placement" not in compile_config(cfg0, spec0).header.encode()


BAD = [
    ([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1]] * 3, "3 rows for a model of 4 MoE layers"),
    ([[0, 1, 2, 3, 4, 5, 6, 9, 0, 1]] * 4, "holds expert 9, outside 0..7"),
    ([[0, 1, 2, 3, 4, 5, 6, 6, 0, 1]] * 4, "has no slot for expert 7"),
    ([[0, 1, 2, 3, 4, 5, 6, 7, 0]] * 4, "do not split evenly over 2 EP ranks"),
    ([[0, 1, 2, 3, 4, 5, 6]] * 4, "7 physical experts for 8 logical"),
    ([[0, 1], [0, 1, 2]], "rows of unequal"),
    ([0, 1], "is not a table"),
    ([[0, 1.5]], "not a small integer"),
]


@pytest.mark.parametrize("table,message", BAD, ids=[m for _, m in BAD])
def test_bad_placement_is_one_line(table, message):
    with pytest.raises(ConfigError) as e:
        _cfg(MOE, dict(framework="fsdp2", dp=2), dict(engine="vllm", tp=2, ep=True), table)
    text = str(e.value)
    assert message in text and "target.placement" in text and "\n" not in text


def test_placement_needs_expert_parallelism():
    with pytest.raises(ConfigError, match="target.placement.*target.ep: true"):
        _cfg(MOE, dict(framework="fsdp2", dp=2), dict(engine="vllm", tp=2),
             [list(range(8))] * 4)


def test_placement_file_json_and_msgpack(tmp_path):
    import msgpack

    table = [[1, 0, 2, 3, 4, 5, 6, 7, 1, 1]] * 4
    (tmp_path / "p.json").write_text(json.dumps({"physical_to_logical_map": table}))
    (tmp_path / "p.msgpack").write_bytes(msgpack.packb({"physical_to_logical_map": table}))
    assert load(str(tmp_path / "p.json")) == load(str(tmp_path / "p.msgpack")) \
        == Placement(np.array(table))
    (tmp_path / "bad").write_bytes(b"\xc1garbage")
    with pytest.raises(ConfigError, match="neither JSON nor msgpack"):
        load(str(tmp_path / "bad"))
    cfg = config_from_dict({"model": {"config": "m/config.json"},
                            "source": {"framework": "fsdp2"},
                            "target": {"engine": "vllm", "ep": True, "placement": "p.json"}},
                           base_dir=str(tmp_path))
    assert cfg.target.placement == Placement(np.array(table))
    with pytest.raises(ConfigError, match="does not exist"):
        config_from_dict({"model": {"config": "m"}, "source": {"framework": "fsdp2"},
                          "target": {"engine": "vllm", "placement": "nope.json"}},
                         base_dir=str(tmp_path))


def test_inspect_shows_the_placement_and_expert_bytes(tmp_path):
    from planner.tools.inspect import inspect_text

    model, source, target, slots = CASES[0]
    _, spec = _cfg(model, source, target)
    table = _random_table(spec, slots, 6)
    plan = compile_config(*_cfg(model, source, target, table))
    path = str(tmp_path / "p.rplan")
    write_plan(path, plan)
    text = inspect_text(path)
    assert f"expert placement {Placement(table).digest()}" in text
    assert "slot -> expert " + " ".join(map(str, table[0])) in text
    per = slots // 2
    slot = 2 * 3 * spec.dims.moe_intermediate * spec.dims.hidden  # bf16 w13 + w2 of a slot
    assert text.count(f"{len(eplb_layers(spec.dims)) * per * slot:,}") == 2  # both ranks
    data = json.loads(inspect_text(path, as_json=True))["placement"]
    assert data["table"] == table.tolist() and data["redundant"] == slots - 8
