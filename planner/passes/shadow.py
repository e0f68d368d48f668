"""Pass 13 (after `emit`, only with `target.shadow`): each target rank's shadow section.

The section (`schemas/shadow.py`) states what the plan writes on the rank (`planner.
writes.written`) and the switch as ops: shadow -> live copies grouped into chunks, layer by
layer (a tensor named `...layers.<i>....` belongs to layer i; the others, such as the
embedding and the head, form one group before layer 0). A full shadow (`budget_bytes` 0)
switches a layer per chunk, each op at its own offset of the region's shadow. A chunked
shadow is compiled as chunk plans (`planner/passes/chunked.py`), each given its section by
`with_shadow` and its own `make`. The pass reads the lowered plan only: sources' parts, and
targets' ops, are left as they are.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from planner.writes import concat, outgoing, written
from schemas.config import ConfigError
from schemas.plan import Plan, RankPlan
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
    """A full shadow's section (`budget` 0): one chunk per layer, each op at its own offset
    of its region's shadow."""
    assert budget == 0, "a chunked shadow is compiled as chunk plans (compile_chunks)"
    if len(rp.regions) >= 1 << 15:
        raise ConfigError(f"target.shadow: target rank {rp.rank} binds {len(rp.regions)} "
                          "tensors, more than a shadow section covers (32767); remove "
                          "target.shadow")
    region, off, n = written(rp, inc)
    layer = np.array([layer_of(rp.regions[r].name) for r in region.tolist()], dtype=np.int64)
    order = np.lexsort((off, region, layer))  # layer by layer, then region, offset
    ops = _layer_chunks(layer[order].tolist(), region[order].tolist(), off[order].tolist(),
                        n[order].tolist())
    cols = np.array(ops, dtype=np.int64).reshape(-1, 5).T
    return ShadowPart(budget, Table.build(SHADOW_REGION_COLUMNS, region=region, offset=off,
                                          nbytes=n),
                      Table.build(SWITCH_COLUMNS, **dict(zip(
                          ("chunk", "region", "offset", "nbytes", "shadow_offset"), cols))))


def _layer_chunks(layer: list[int], region: list[int], off: list[int], n: list[int]
                  ) -> list[tuple[int, int, int, int, int]]:
    """(chunk, region, offset, nbytes, shadow_offset) ops of runs given layer by layer: one
    chunk per layer, the shadow mirroring each region."""
    if not layer:
        return []
    ids = np.cumsum(np.r_[0, np.diff(layer) != 0]).tolist()
    return list(zip(ids, region, off, n, off))
