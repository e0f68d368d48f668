"""A shadow section's tables are bounded by what they describe, checked at load before the
executor makes anything per op: runs at most `MAX_RUNS` and coalesced, switch ops coalesced
as compiled (none of one chunk touching, at most one per run plus one per chunk boundary),
chunks at most one per region. A section whose switch is valid by every other rule but
split into 1-byte ops (millions of them for a real model) is refused in one line, never by
the allocator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from executor.core import Executor
from executor.errors import BindError, PlanBoundsError
from executor.transports.local import Fabric
from schemas.plan import Plan
from schemas.shadow import MAX_RUNS, SHADOW_REGION_COLUMNS, SWITCH_COLUMNS, shadow_violations
from schemas.table import Table
from tests.support.shadow_plans import CASES, _compile


@pytest.fixture(scope="module")
def plan() -> Plan:
    return _compile(CASES[0], "full")


def _target(plan: Plan):
    return next(rp for rp in plan.ranks if rp.role == "target")


def _split(rp, ops: int | None, per_chunk: bool = False, gaps: bool = False):
    """`rp` with its first `ops` switch ops (None: as many as make over 2 * `MAX_RUNS`
    bytes) cut into 1-byte ops (each its own
    chunk where `per_chunk`, the later chunks renumbered after them); `gaps`: its runs cut
    into 1-byte runs one byte apart too (every other byte)."""
    s, g = rp.shadow.switch, rp.shadow.regions
    n = s["nbytes"].astype(np.int64)
    if ops is None:
        ops = int(np.searchsorted(np.cumsum(n), 2 * MAX_RUNS + 2)) + 1
    cut = np.arange(len(s)) < ops
    n1 = np.where(cut, n, 1)  # pieces per op
    rep = np.repeat(np.arange(len(s)), n1)
    k = np.arange(len(rep)) - np.repeat(np.cumsum(n1) - n1, n1)
    piece = np.where(cut[rep], 1, n[rep])
    keep = ~cut[rep] | (k % 2 == 0) if gaps else np.ones(len(rep), bool)
    rep, k, piece = rep[keep], k[keep], piece[keep]
    chunk = s["chunk"][rep].astype(np.int64)
    if per_chunk:
        extra = np.cumsum(cut[rep]) - 1  # each cut piece one more chunk
        chunk = chunk + np.maximum(extra, 0)
    cols = dict(region=s["region"][rep], offset=s["offset"][rep] + k, nbytes=piece,
                shadow_offset=s["shadow_offset"][rep] + k, chunk=chunk)
    regions = Table.build(SHADOW_REGION_COLUMNS, region=cols["region"], offset=cols["offset"],
                          nbytes=cols["nbytes"]) if gaps else g
    return dataclasses.replace(rp, shadow=dataclasses.replace(
        rp.shadow, regions=regions, switch=Table.build(SWITCH_COLUMNS, **cols)))


def _load(plan: Plan, rp) -> None:
    ranks = tuple(rp if p.rank == rp.rank else p for p in plan.ranks)
    plan = dataclasses.replace(plan, ranks=ranks)
    Executor(plan.header, rp, {}, transport="local", rendezvous=Fabric(), timeout_s=2)


def test_the_compiled_section_passes(plan: Plan) -> None:
    rp = _target(plan)
    assert list(shadow_violations(rp)) == []
    with pytest.raises(BindError):  # past every plan check: stops at the tensors
        _load(plan, rp)


@pytest.mark.parametrize("ops,per_chunk,gaps,says", [
    (None, False, False, f"at most {MAX_RUNS:,} runs"),  # 1-byte ops past the cap
    (None, False, True, f"at most {MAX_RUNS:,} runs"),  # 1-byte runs past the cap
    (1, False, False, "ops are coalesced"),  # one op in 1-byte ops of its chunk
    (1, True, False, "chunks for"),  # ... each its own chunk
])
def test_a_switch_split_into_1_byte_ops_is_refused_at_load(plan: Plan, ops, per_chunk, gaps,
                                                           says: str) -> None:
    rp = _split(_target(plan), ops, per_chunk, gaps)
    assert len(rp.shadow.switch) > 1000
    assert list(shadow_violations(rp))
    with pytest.raises(PlanBoundsError) as e:
        _load(plan, rp)
    assert "\n" not in str(e.value) and says in str(e.value)
