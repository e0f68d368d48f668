"""`rdma-plan inspect` of a chunked plan: a chunked shadow's chunk plans in one file
(`schemas/chunked_plan.py`).

Shows the budget, the chunks (their tensors' layers, bytes per target rank) and each rank's
extra memory: N on a target (the buffer), 0 on a source.
"""

from __future__ import annotations

import json
from typing import Any

from planner.passes.shadow import layer_of
from planner.tools.verify_chunked import chunk_targets
from schemas.chunked_plan import load_chunked
from schemas.plan import STAGING

MIXED = ("mixed-version window: while chunks are switched one by one, the layers already "
         "switched serve version N+1 and the rest version N; keep the engine paused across the "
         "whole chunked refit unless you accept that mix")


def chunked_summary(path: str) -> dict[str, Any]:
    """The budget, each chunk's tensors, layers and bytes, and each rank's extra memory."""
    budget, plans = load_chunked(path)
    chunks = []
    for p in plans:
        names = sorted(set().union(*chunk_targets(p).values()))
        layers = sorted({layer_of(n) for n in names})
        chunks.append({"tensors": len(names), "layers": layers, "bytes": p.header.stats.bytes,
                       "target_bytes": {r: sum(g.nbytes for g in p.ranks[r].regions
                                               if g.name != STAGING) for r in chunk_targets(p)}})
    ranks = []
    for rp in plans[0].ranks:
        t = rp.role == "target"
        weights = sum(c["target_bytes"].get(rp.rank, 0) for c in chunks)
        ranks.append({"rank": rp.rank, "role": rp.role, "extra_memory": {
            "paused": 0, "full_shadow": weights if t else 0, "chunked_shadow": budget if t else 0}})
    return {"plan": path, "chunked_budget": budget, "chunks": chunks, "ranks": ranks,
            "mixed_version_window": MIXED}


def inspect_chunked(path: str, as_json: bool = False) -> str:
    """`chunked_summary` as text (or JSON)."""
    s = chunked_summary(path)
    if as_json:
        return json.dumps(s, indent=1)
    b = s["chunked_budget"]
    lines = [f"chunked plan {path}: budget {b:,} bytes ({b / 2**20:.1f} MiB), "
             f"{len(s['chunks'])} chunks, run in order (executor/chunked.py)",
             f"extra memory per target rank: chunked shadow + {b / 2**20:.1f} MiB (the "
             "budget; column chunked); 0 on a source",
             s["mixed_version_window"], "",
             f"{'chunk':>5}{'tensors':>9}{'layers':>14}{'bytes':>14}{'max on a target':>17}"]
    for k, c in enumerate(s["chunks"]):
        ly = c["layers"]
        span = "-" if not ly else (f"{ly[0]}" if len(ly) == 1 else f"{ly[0]}..{ly[-1]}")
        lines.append(f"{k:>5}{c['tensors']:>9}{span:>14}{c['bytes']:>14,}"
                     f"{max(c['target_bytes'].values(), default=0):>17,}")
    lines += ["", f"{'rank':>5} {'role':<7}{'paused':>8}{'shadow':>16}{'chunked':>12}"]
    lines += [f"{r['rank']:>5} {r['role']:<7}{0:>8}{r['extra_memory']['full_shadow']:>16,}"
              f"{r['extra_memory']['chunked_shadow']:>12,}" for r in s["ranks"]]
    return "\n".join(lines)
