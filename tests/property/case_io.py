"""A `Case` as plain JSON (no pickle), so another process can compile the same inputs.

`python -m tests.property.case_io CASE.json OUT.rplan` compiles a case and writes the plan.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from planner.compiler import compile_layouts
from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.spec import spec_from_hf
from schemas.config import config_from_dict
from schemas.plan import write_plan
from tests.property.strategies import Case, full_spec

_SECTIONS = ("model", "source", "target", "cluster", "options")


def _layout_data(layout: Layout) -> dict[str, Any]:
    return {"side": layout.side, "framework": layout.framework, "replicas": layout.replicas,
            "ranks": [[rl.rank, rl.replica,
                       [[pt.name, list(pt.shape), pt.dtype,
                         [[p.tensor, list(p.offsets), list(p.sizes), list(p.at),
                           None if p.dims is None else list(p.dims)] for p in pt.pieces]]
                        for pt in rl.tensors]] for rl in layout.ranks]}


def _layout(data: dict[str, Any]) -> Layout:
    ranks = tuple(RankLayout(r, rep, tuple(
        PhysicalTensor(name, tuple(shape), dtype, tuple(
            Piece(t, tuple(o), tuple(s), tuple(a), None if d is None else tuple(d))
            for t, o, s, a, d in pieces)) for name, shape, dtype, pieces in tensors))
        for r, rep, tensors in data["ranks"])
    return Layout(data["side"], data["framework"], ranks, data["replicas"])


def case_json(case: Case) -> str:
    cfg = dataclasses.asdict(case.cfg)
    cfg["model"]["overrides"] = dict(case.cfg.model.overrides)  # YAML gives a mapping
    return json.dumps({"hf": case.hf, "config": {k: cfg[k] for k in _SECTIONS},
                       "src": _layout_data(case.src), "dst": _layout_data(case.dst)})


def case_from_json(text: str) -> Case:
    data = json.loads(text)
    cfg = config_from_dict(data["config"])
    return Case(full_spec(spec_from_hf(data["hf"]), cfg), _layout(data["src"]),
                _layout(data["dst"]), cfg, data["hf"])


def main(argv: list[str]) -> None:
    with open(argv[0], encoding="utf-8") as f:
        case = case_from_json(f.read())
    write_plan(argv[1], compile_layouts(case.cfg, case.spec, case.src, case.dst))


if __name__ == "__main__":
    main(sys.argv[1:])
