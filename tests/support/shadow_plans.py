"""Tiny plans compiled with a shadow section (`target.shadow`) and broken copies of one
rank's section, shared by tests/planner/test_shadow_section.py and
tests/executor/test_shadow_plan.py; the chunked shadow's chunk plans written to a file
(`compile_chunked_file`) and the cases' layouts, for tests/executor/test_chunked*.py and
tests/planner/test_chunked_plan.py."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from planner.compiler import compile_config
from planner.spec import load_spec
from planner.validate import validate
from schemas.config_load import config_from_dict
from schemas.plan import STAGING, Plan, RankPlan
from schemas.shadow import SWITCH_COLUMNS
from schemas.table import Table

MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "plans", "models")
# tiny Qwen3 (direct writes), tiny gpt-oss (transposed experts: UNPACKs on the targets)
CASES = [("tiny-qwen3", dict(framework="megatron", tp=2), dict(engine="vllm", tp=1,
                                                                replicas=2)),
         ("tiny-gpt-oss", dict(framework="fsdp2", dp=2), dict(engine="vllm", tp=2))]


def _compile(case, shadow=None) -> Plan:
    model, source, target = case
    target = dict(target, **({} if shadow is None else {"shadow": shadow}))
    cfg = config_from_dict({"model": {"config": f"{model}/config.json"}, "source": source,
                            "target": target, "cluster": {"gpus_per_host": 8}},
                           base_dir=MODELS)
    spec = load_spec(cfg.model_config_path)
    validate(cfg, spec)
    return compile_config(cfg, spec)


def _with(rp: RankPlan, **cols) -> RankPlan:
    s = rp.shadow.switch
    new = {n: np.array(cols.get(n, s[n])) for n, _ in SWITCH_COLUMNS}
    return dataclasses.replace(rp, shadow=dataclasses.replace(
        rp.shadow, switch=Table.build(SWITCH_COLUMNS, **new)))


def _broken(rp: RankPlan) -> dict[str, RankPlan]:
    s = rp.shadow.switch
    n = len(s)
    last = n - 1
    chunk = s["chunk"].copy()
    chunk[0], chunk[last] = chunk[last], chunk[0]
    nb = s["nbytes"].copy()
    nb[0] += 1  # overlaps the next op or runs past the region
    off = s["offset"].copy()
    off[1] += 8  # leaves bytes no op copies
    reg = s["region"].copy()
    reg[0] = len(rp.regions) - 1 if rp.regions[-1].name == STAGING else 10_000
    return {"chunk order": _with(rp, chunk=chunk), "overlap": _with(rp, nbytes=nb),
            "gap": _with(rp, offset=off), "region": _with(rp, region=reg),
            "dropped op": _with(rp, **{k: s[k][1:] for k, _ in SWITCH_COLUMNS}),
            "on a source": rp}


def layouts(case):
    """(spec, source layout, target layout) of a case."""
    from planner.frameworks import build_layout
    model, source, target = case
    cfg = config_from_dict({"model": {"config": f"{model}/config.json"}, "source": source,
                            "target": target, "cluster": {"gpus_per_host": 8}},
                           base_dir=MODELS)
    spec = load_spec(cfg.model_config_path)
    return spec, build_layout(spec, cfg.source), build_layout(spec, cfg.target)


def compile_chunked_file(case, budget: int, path: str) -> list[Plan]:
    """The chunk plans of a chunked shadow of `budget` bytes, written to `path`."""
    from schemas.chunked_plan import write_chunked
    model, source, target = case
    cfg = config_from_dict({"model": {"config": f"{model}/config.json"}, "source": source,
                            "target": dict(target, shadow={"budget_bytes": budget}),
                            "cluster": {"gpus_per_host": 8}}, base_dir=MODELS)
    spec = load_spec(cfg.model_config_path)
    validate(cfg, spec)
    plans = compile_config(cfg, spec)
    write_chunked(path, plans, budget)
    return plans
