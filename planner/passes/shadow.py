"""Pass (after `emit`, only with `target.shadow`): each target rank's shadow section.

The section (`schemas/shadow.py`) states what the plan writes on the rank (`planner.
writes.written`) and the switch as ops: shadow -> live copies grouped into chunks,
layer by layer (a tensor named `...layers.<i>....` belongs to layer i; the others, such as
the embedding and the head, form one group before layer 0). A full shadow (`budget_bytes`
0) switches a layer per chunk, each op at its own offset of the region's shadow; a bounded
shadow packs whole layers into chunks of at most the budget (a layer larger than the budget
is cut at the budget), each chunk's ops at `ALIGN`-aligned offsets of one buffer. The pass
reads the lowered plan only: sources' parts, and targets' ops, are left as they are.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from planner.writes import concat, outgoing, written
from schemas.config import ConfigError
from schemas.plan import Plan, RankPlan
from schemas.protocol import ALIGN
from schemas.shadow import SHADOW_REGION_COLUMNS, SWITCH_COLUMNS, ShadowPart
from schemas.table import Table

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int:
    """The decoder layer a tensor name belongs to, or -1 (embedding, head, final norm)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def with_shadow(plan: Plan, budget: int, make: Callable | None = None) -> Plan:
    """`plan` with a shadow section on every target rank (`budget`: 0 full, else bytes);
    `make(rank plan, its incoming writes, budget)` makes it (default `shadow_part`)."""
    make = shadow_part if make is None else make
    incoming: dict[int, list] = {}
    for rp in plan.ranks:
        for peer, part in outgoing(rp).items():
            incoming.setdefault(peer, []).append(part)
    ranks = tuple(rp if rp.role != "target" else dataclasses.replace(
        rp, shadow=make(rp, concat(incoming.pop(rp.rank, [])), budget))
        for rp in plan.ranks)
    return dataclasses.replace(plan, ranks=ranks)


def shadow_part(rp: RankPlan, inc, budget: int) -> ShadowPart:
    if len(rp.regions) >= 1 << 15:
        raise ConfigError(f"target.shadow: target rank {rp.rank} binds {len(rp.regions)} "
                          "tensors, more than a shadow section covers (32767); remove "
                          "target.shadow")
    region, off, n = written(rp, inc)
    layer = np.array([layer_of(rp.regions[r].name) for r in region.tolist()], dtype=np.int64)
    order = np.lexsort((off, region, layer))  # layer by layer, then region, offset
    ops = _chunks(layer[order].tolist(), region[order].tolist(), off[order].tolist(),
                  n[order].tolist(), budget)
    cols = np.array(ops, dtype=np.int64).reshape(-1, 5).T
    return ShadowPart(budget, Table.build(SHADOW_REGION_COLUMNS, region=region, offset=off,
                                          nbytes=n),
                      Table.build(SWITCH_COLUMNS, **dict(zip(
                          ("chunk", "region", "offset", "nbytes", "shadow_offset"), cols))))


def _chunks(layer: list[int], region: list[int], off: list[int], n: list[int], budget: int
            ) -> list[tuple[int, int, int, int, int]]:
    """(chunk, region, offset, nbytes, shadow_offset) ops of runs given layer by layer."""
    ops: list[tuple[int, int, int, int, int]] = []
    if not layer:
        return ops
    if budget == 0:  # a full shadow: one chunk per layer, the shadow mirrors each region
        ids = np.cumsum(np.r_[0, np.diff(layer) != 0]).tolist()
        return list(zip(ids, region, off, n, off))
    group_bytes: dict[int, int] = {}
    for g, b in zip(layer, n):
        group_bytes[g] = group_bytes.get(g, 0) + b
    chunk, used, prev = 0, 0, None
    for g, r, o, b in zip(layer, region, off, n):
        if g != prev and used and _up(used) + group_bytes[g] > budget:
            chunk, used = chunk + 1, 0  # a layer that fits a chunk starts one of its own
        prev = g
        while b > 0:
            at = _up(used)
            if at >= budget:
                chunk, used, at = chunk + 1, 0, 0
            take = min(b, budget - at)
            ops.append((chunk, r, o, take, at))
            used, o, b = at + take, o + take, b - take
    return ops


def _up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN
