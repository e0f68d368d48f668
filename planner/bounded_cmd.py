"""`rdma-plan compile / verify / inspect` of a bounded-shadow plan (`schemas/bounded_plan.py`).

`compile` of a config with `target.shadow: {budget_bytes: N}` compiles each chunk of
`planner/passes/bounded.py` like any plan (`compile_bounded`) and writes the chunk plans;
`verify` runs every check of `planner/verify.py` on each chunk plan, then the file's own
rules (every chunk has the same ranks and roles; each target rank's chunks hold each tensor
of the index's set for that rank in exactly one chunk, so with each chunk's coverage every
target byte is written exactly once; each chunk lands at most N bytes on a target);
`inspect` shows the budget, the chunks (their tensors' layers, bytes per target rank) and
each rank's extra memory: N on a target (the buffer), 0 on a source.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from planner.compiler import compile_layouts, no_cycle_collection
from planner.fp8 import with_scales
from planner.frameworks import build_layout
from planner.passes.bounded import chunk_names, with_bounded
from planner.passes.emit import tensor_regions
from planner.passes.shadow import layer_of
from planner.spec import ModelSpec
from schemas.bounded_plan import load_bounded, load_bounded_index, set_violations, write_bounded
from schemas.config import Config
from schemas.integrity import plan_key
from schemas.plan import STAGING, Plan

MIXED = ("mixed-version window: while chunks are switched one by one, the layers already "
         "switched serve version N+1 and the rest version N; keep the engine paused across the "
         "whole bounded refit unless you accept that mix")


def compile_bounded(cfg: Config, spec: ModelSpec, src_layout, dst_layout) -> list[Plan]:
    """The chunk plans of a bounded shadow (`cfg.target.shadow.budget_bytes` > 0), in the
    order they run."""
    assert cfg.target.shadow is not None and cfg.target.shadow.budget_bytes > 0
    budget = cfg.target.shadow.budget_bytes
    plain = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, shadow=None))
    plans = []
    for names in chunk_names(tensor_regions(dst_layout), budget):
        keep = set(names)
        sub = dataclasses.replace(dst_layout, ranks=tuple(
            dataclasses.replace(rl, tensors=tuple(t for t in rl.tensors if t.name in keep))
            for rl in dst_layout.ranks))
        plans.append(with_bounded(compile_layouts(plain, spec, src_layout, sub), budget))
    return plans


def compile_bounded_config(cfg: Config, spec: ModelSpec) -> list[Plan]:
    """`compile_bounded` of a checked config (layouts built from its rules, not traced)."""
    with no_cycle_collection():
        src, dst = build_layout(spec, cfg.source), build_layout(spec, cfg.target)
        if cfg.target.dtype == "fp8_block128":
            spec = with_scales(spec)
        return compile_bounded(cfg, spec, src, dst)


def compile_bounded_to(cfg: Config, spec: ModelSpec, out_path: str, progress=None,
                       t0: float | None = None, sign_key: str | bytes | None = None
                       ) -> dict[str, Any]:
    """Compile the chunk plans of a bounded-shadow config and write them to `out_path`."""
    t0 = time.perf_counter() if t0 is None else t0
    key = None if sign_key is None else plan_key(sign_key)
    if progress is not None:
        progress("bounded chunks")
    budget = cfg.target.shadow.budget_bytes
    plans = compile_bounded_config(cfg, spec)
    tmp = f"{out_path}.{os.getpid()}.compiling"
    try:
        size = write_bounded(tmp, plans, budget, key)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"bounded_budget": budget, "chunks": len(plans),
            "bytes": sum(p.header.stats.bytes for p in plans), "plan_bytes": size,
            "seconds": round(time.perf_counter() - t0, 3)}


def _targets(p: Plan) -> dict[int, set[str]]:
    return {rp.rank: {g.name for g in rp.regions if g.name != STAGING}
            for rp in p.ranks if rp.role == "target"}


def verify_bounded(path: str) -> list[str]:
    """Every chunk plan's violations (`verify_plan`, prefixed `chunk k:`), then the file's."""
    from planner.verify import verify_plan

    idx, budget, plans = load_bounded_index(path)
    out = [f"chunk {k}: {m}" for k, p in enumerate(plans) for m in verify_plan(p)]
    roles = [tuple(rp.role for rp in p.ranks) for p in plans]
    if len(set(roles)) > 1:
        out.append("the chunk plans have different ranks or roles; recompile the plan")
        return out
    targets = sorted(_targets(plans[0]))
    for r in targets:
        out += set_violations(r, [p.ranks[r] for p in plans], idx.targets.get(r))
    if set(idx.targets) != set(targets):
        out.append(f"the bounded index states the tensors of target ranks "
                   f"{sorted(idx.targets)}, the chunks have targets {targets}; recompile the plan")
    for k, p in enumerate(plans):
        for r in _targets(p):
            landed = sum(g.nbytes for g in p.ranks[r].regions if g.name != STAGING)
            if landed > budget:
                out.append(f"chunk {k}: lands {landed} bytes on target rank {r}, more than the "
                           f"{budget}-byte budget; recompile the plan")
    return out


def bounded_summary(path: str) -> dict[str, Any]:
    budget, plans = load_bounded(path)
    chunks = []
    for p in plans:
        names = sorted(set().union(*_targets(p).values()))
        layers = sorted({layer_of(n) for n in names})
        chunks.append({"tensors": len(names), "layers": layers, "bytes": p.header.stats.bytes,
                       "target_bytes": {r: sum(g.nbytes for g in p.ranks[r].regions
                                               if g.name != STAGING) for r in _targets(p)}})
    ranks = []
    for rp in plans[0].ranks:
        t = rp.role == "target"
        weights = sum(c["target_bytes"].get(rp.rank, 0) for c in chunks)
        ranks.append({"rank": rp.rank, "role": rp.role, "extra_memory": {
            "paused": 0, "full_shadow": weights if t else 0, "bounded_shadow": budget if t else 0}})
    return {"plan": path, "bounded_budget": budget, "chunks": chunks, "ranks": ranks,
            "mixed_version_window": MIXED}


def inspect_bounded(path: str, as_json: bool = False) -> str:
    s = bounded_summary(path)
    if as_json:
        return json.dumps(s, indent=1)
    b = s["bounded_budget"]
    lines = [f"bounded-shadow plan {path}: budget {b:,} bytes ({b / 2**20:.1f} MiB), "
             f"{len(s['chunks'])} chunks, run in order (executor/bounded.py)",
             f"extra memory per target rank: bounded shadow + {b / 2**20:.1f} MiB (the "
             "budget; column bounded); 0 on a source",
             s["mixed_version_window"], "",
             f"{'chunk':>5}{'tensors':>9}{'layers':>14}{'bytes':>14}{'max on a target':>17}"]
    for k, c in enumerate(s["chunks"]):
        ly = c["layers"]
        span = "-" if not ly else (f"{ly[0]}" if len(ly) == 1 else f"{ly[0]}..{ly[-1]}")
        lines.append(f"{k:>5}{c['tensors']:>9}{span:>14}{c['bytes']:>14,}"
                     f"{max(c['target_bytes'].values(), default=0):>17,}")
    lines += ["", f"{'rank':>5} {'role':<7}{'paused':>8}{'shadow':>16}{'bounded':>12}"]
    lines += [f"{r['rank']:>5} {r['role']:<7}{0:>8}{r['extra_memory']['full_shadow']:>16,}"
              f"{r['extra_memory']['bounded_shadow']:>12,}" for r in s["ranks"]]
    return "\n".join(lines)
