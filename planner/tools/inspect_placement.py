"""`rdma-plan inspect` for a plan compiled for an expert placement (`target.placement`): the
placement (per MoE layer, the logical expert of every physical slot, its redundant
replicas) and each target rank's stacked expert bytes (the regions a placement change
rewrites in part, and never reallocates)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from schemas.header import PlanHeader

_SLOTS = re.compile(r"^model\.layers\.(\d+)\..*experts\.(?:routed_experts\.)?(w13|w2)_weight$")
SHOWN = 8
"""Layers and ranks shown in the text (first and last half); `--json` lists all."""


def placement_summary(path: str, header: PlanHeader) -> dict[str, Any] | None:
    """The placement and per-target-rank expert bytes, or None without a placement."""
    p = header.placement
    if p is None:
        return None
    from planner.placement import ep_rank  # (the compiler's passes: only with a placement)
    from planner.tools.planfile import PlanFile

    ranks = []
    with PlanFile(path) as f:
        for r in range(header.sources, header.world):
            regs = [g for g in f.rank(r).regions if _SLOTS.match(g.name)]
            slots = regs[0].shape[0] if regs else 0
            ranks.append({"rank": r, "slots": slots,
                          "expert_bytes": int(sum(g.nbytes for g in regs))})
    experts = int(p.table.max()) + 1
    for x in ranks:
        ep, per = ep_rank(header, x["rank"]), x["slots"]
        x["ep"], x["experts_layer0"] = ep, p.table[0, ep * per:(ep + 1) * per].tolist()
    counts = [np.bincount(row, minlength=experts) for row in p.table]
    return {"digest": p.digest(), "moe_layers": p.layers, "physical": p.physical,
            "logical": experts, "redundant": p.physical - experts,
            "layers": [{"layer": i, "max_replicas": int(c.max()),
                        "replicated": np.flatnonzero(c > 1).tolist()}
                       for i, c in enumerate(counts)],
            "table": p.table.tolist(), "ranks": ranks}


def placement_lines(s: dict[str, Any] | None) -> list[str]:
    if s is None:
        return []
    lines = ["", f"expert placement {s['digest']}: {s['moe_layers']} MoE layers x "
             f"{s['physical']} physical experts ({s['logical']} logical + {s['redundant']} "
             "redundant); another placement of as many slots keeps every region below"]
    layers = s["layers"]
    shown = layers if len(layers) <= SHOWN else layers[:SHOWN // 2] + layers[-SHOWN // 2:]
    for x in shown:
        hot = ", ".join(map(str, x["replicated"][:12])) + \
            (" ..." if len(x["replicated"]) > 12 else "")
        lines.append(f"  MoE layer {x['layer']:>3}: slot -> expert "
                     f"{_row(s['table'][x['layer']])}; replicated: {hot or 'none'} "
                     f"(at most x{x['max_replicas']})")
    if len(layers) > len(shown):
        lines.append(f"  ... ({len(layers) - len(shown)} more layers; --json lists all)")
    lines.append(f"  {'rank':>5}{'ep':>5}{'slots':>7}{'expert bytes':>18}  experts (MoE layer 0)")
    ranks = s["ranks"]
    shown_r = ranks if len(ranks) <= 2 * SHOWN else ranks[:SHOWN] + ranks[-SHOWN:]
    lines += [f"  {x['rank']:>5}{x['ep']:>5}{x['slots']:>7}{x['expert_bytes']:>18,}  "
              f"{_row(x['experts_layer0'])}" for x in shown_r]
    if len(ranks) > len(shown_r):
        lines.append(f"  ... ({len(ranks) - len(shown_r)} more target ranks; --json lists all)")
    return lines


def _row(values: list[int], limit: int = 16) -> str:
    text = " ".join(map(str, values[:limit]))
    return text + (f" ... ({len(values)})" if len(values) > limit else "")
