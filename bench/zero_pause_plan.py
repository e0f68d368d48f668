"""The plan of bench/zero_pause.py: sources that send each target weight whole."""

from __future__ import annotations

from schemas.header import PlanHeader
from schemas.plan import (
    BATCH_COLUMNS,
    COPY_COLUMNS,
    DONE,
    READY,
    SIGNAL_COLUMNS,
    WRITE_COLUMNS,
    Plan,
    RankPlan,
    Region,
    Table,
)
from schemas.plan_write import write_plan

SIZE = {"bfloat16": 2, "float32": 4}


def make_plan(path: str | None, d: int, k: int, sources: int, targets: int, dtype: str,
              only: range | None = None) -> Plan:
    """Sources 0..S-1, targets S..S+T-1; target t's "w{i}" [d, d] comes whole from source
    i % S (its region "t{t}.w{i}"); `only`: those weights only (a chunked shadow's chunk)."""
    n = d * d * SIZE[dtype]
    only = range(k) if only is None else only

    def sig(rows: list[tuple[int, int]]) -> Table:
        return Table.build(SIGNAL_COLUMNS, stage=[0] * len(rows), peer=[p for p, _ in rows],
                           kind=[kind for _, kind in rows])
    empty = Table.empty
    tgts = range(sources, sources + targets)
    ranks = []
    for s in range(sources):
        mine = [(t, i) for t in tgts for i in only if i % sources == s]
        regions = tuple(Region(f"t{t}.w{i}", dtype, (d, d), n) for t, i in mine)
        w = Table.build(WRITE_COLUMNS, dst_rank=[t for t, _ in mine],
                        src_region=list(range(len(mine))), src_offset=[0] * len(mine),
                        dst_region=[i - only[0] for _, i in mine],
                        dst_offset=[0] * len(mine),
                        nbytes=[n] * len(mine))
        b = Table.build(BATCH_COLUMNS, stage=[0], nic=[0], start=[0], stop=[len(mine)])
        ranks.append(RankPlan(s, "source", 0, 0, ("lo",), regions, w, b, empty(COPY_COLUMNS),
                              sig([(t, DONE) for t in tgts]), sig([(t, READY) for t in tgts]),
                              tuple((t, tuple((i, n) for i in range(len(only)))) for t in tgts),
                              1))
    for t in tgts:
        ranks.append(RankPlan(t, "target", 0, 1, ("lo",),
                              tuple(Region(f"w{i}", dtype, (d, d), n) for i in only),
                              empty(WRITE_COLUMNS), empty(BATCH_COLUMNS), empty(COPY_COLUMNS),
                              sig([(s, READY) for s in range(sources)]),
                              sig([(s, DONE) for s in range(sources)]), (), 1))
    plan = Plan(PlanHeader(fingerprint=f"zero-pause-{d}x{k}-{only[0]}", world=len(ranks)),
                tuple(ranks))
    if path is not None:
        write_plan(path, plan)
    return plan
