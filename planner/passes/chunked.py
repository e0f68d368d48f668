"""Pass (chunked plans, `target.shadow: {budget_bytes: N}`): the chunks of a chunked shadow.

The target's tensors are cut into chunks, layer by layer (`layer_of`: the non-layer tensors,
embedding, head, final norm, form one group before layer 0): a chunk is a set of WHOLE
target tensors whose bytes, each at an `ALIGN`-aligned offset, fit `N` on every target rank;
a layer that does not fit one chunk is cut between its tensors, and a tensor larger than `N`
is refused (one line, naming it). The compiler (`planner.compiler.compile_chunks`) compiles
each chunk like any plan, with the target layout restricted to the chunk's tensors
(`only_tensors`): its writes and UNPACKs address those tensors only. On every target rank
the chunk plan carries a shadow section with `budget` N and one chunk whose ops read
`shadow_offset = base(tensor) + offset`: the executor (`executor/chunked.py`) binds the
chunk's tensors as views of ONE buffer of N bytes at those bases, so that buffer is where
the chunk's bytes land (no stage of it lands more than N bytes on a target), and the switch
copies them into the live tensors. The chunk plans travel in one file (`schemas/chunked_plan.py`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from planner.layouts.base import Layout
from planner.passes.shadow import layer_of, with_shadow
from planner.writes import written
from schemas.chunked_plan import bases
from schemas.config import ConfigError
from schemas.plan import Plan, RankPlan, Region
from schemas.protocol import ALIGN
from schemas.shadow import SHADOW_REGION_COLUMNS, SWITCH_COLUMNS, ShadowPart
from schemas.table import Table


def _up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


def chunk_names(regions: list[tuple[Region, ...]], budget: int) -> list[list[str]]:
    """The target tensor names of each chunk (`regions`: each target rank's), layer by
    layer, whole tensors whose aligned bytes fit `budget` on every rank. Refuses a tensor
    larger than the budget (`ConfigError`, one line)."""
    size: dict[str, list[int]] = {}  # name -> its bytes on each rank (0 where absent)
    for r, regs in enumerate(regions):
        for g in regs:
            size.setdefault(g.name, [0] * len(regions))[r] = g.nbytes
    biggest = max(size.items(), key=lambda kv: max(kv[1]), default=None)
    if biggest is not None and max(biggest[1]) > budget:
        b = max(biggest[1])
        raise ConfigError(f"target.shadow.budget_bytes = {budget} is smaller than target "
                          f"tensor {biggest[0]!r} ({b} bytes on target rank "
                          f"{biggest[1].index(b)}); a chunked shadow moves whole tensors: "
                          f"raise it to at least {_up(b)}")
    layers: dict[int, list[str]] = {}
    for name in size:  # first-seen order: each rank's named_parameters() order
        layers.setdefault(layer_of(name), []).append(name)
    chunks: list[list[str]] = []
    used = np.zeros(len(regions), dtype=np.int64)
    cur: list[str] = []

    def cost(names: list[str]) -> np.ndarray:
        return np.array([sum(_up(size[n][r]) for n in names) for r in range(len(regions))],
                        dtype=np.int64)

    for g in sorted(layers):
        names = layers[g]
        whole = cost(names)
        if cur and (used + whole).max() > budget:
            chunks.append(cur)
            cur, used = [], np.zeros_like(used)
        for n in names:  # the layer whole if it fits, else cut between its tensors
            c = cost([n])
            if cur and (used + c).max() > budget:
                chunks.append(cur)
                cur, used = [], np.zeros_like(used)
            cur.append(n)
            used += c
    if cur:
        chunks.append(cur)
    return chunks


def only_tensors(layout: Layout, names: list[str]) -> Layout:
    """`layout` with each rank's tensors restricted to `names` (one chunk's)."""
    keep = set(names)
    return dataclasses.replace(layout, ranks=tuple(
        dataclasses.replace(rl, tensors=tuple(t for t in rl.tensors if t.name in keep))
        for rl in layout.ranks))


def with_chunk_shadow(plan: Plan, budget: int) -> Plan:
    """`plan` (one chunk) with a chunked shadow section on every target rank: one chunk,
    each written run at `base(its tensor) + offset` of the buffer."""
    return with_shadow(plan, budget, chunk_part)


def chunk_part(rp: RankPlan, inc, budget: int) -> ShadowPart:
    region, off, n = written(rp, inc)
    base = np.array(bases(rp) or [0], dtype=np.int64)
    z = np.zeros(len(region), dtype=np.int64)
    return ShadowPart(budget, Table.build(SHADOW_REGION_COLUMNS, region=region, offset=off,
                                          nbytes=n),
                      Table.build(SWITCH_COLUMNS, chunk=z, region=region, offset=off,
                                  nbytes=n, shadow_offset=base[region] + off))
