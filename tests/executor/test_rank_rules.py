"""Every rule of `verify` that one rank's own part decides is also checked when that rank
loads: the bounds proof (`schemas.bounds`) and each of `schemas.rankcheck.RULES`. Each case
below breaks one rule in one rank of a compiled plan: `verify` refuses the plan, and the
executor refuses to load that rank (`PlanBoundsError`, one line) before it binds, allocates
or connects anything; the untouched plan passes both."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from executor.core import Executor
from executor.errors import BindError, PlanBoundsError
from executor.transports.local import Fabric
from planner.tools.verify import verify_plan
from schemas import rankcheck
from schemas.plan import (
    COPY_COLUMNS,
    DONE,
    PACK,
    SIGNAL_COLUMNS,
    UNPACK,
    WRITE_COLUMNS,
    Plan,
)
from schemas.table import Table
from tests.support.shadow_plans import CASES, _broken, _compile


def _table(t: Table, schema, **cols) -> Table:
    return Table.build(schema, **{n: np.array(cols.get(n, t[n])) for n, _ in schema})


def _rank(plan: Plan, r: int, **fields) -> Plan:
    return dataclasses.replace(plan, ranks=tuple(
        dataclasses.replace(rp, **fields) if rp.rank == r else rp for rp in plan.ranks))


def _packer(plan: Plan) -> tuple[int, np.ndarray]:
    """A source rank with two PACKs into staging in one stage, and those two rows."""
    for rp in plan.ranks:
        c = rp.copies
        rows = np.flatnonzero(c["kind"] == PACK)
        for s in np.unique(c["stage"][rows]).tolist():
            same = rows[c["stage"][rows] == s]
            if len(same) >= 2:
                return rp.rank, same[:2]
    raise AssertionError("no rank packs twice in a stage")


def _mutants(plan: Plan, shadowed: Plan) -> dict[str, tuple[Plan, int]]:
    out: dict[str, tuple[Plan, int]] = {}
    src = plan.ranks[0]
    w = src.writes
    out["bounds"] = (_rank(plan, 0, writes=_table(w, WRITE_COLUMNS, dst_offset=np.r_[
        w["dst_offset"][:-1], 1 << 40])), 0)
    r, (a, b) = _packer(plan)
    rp = plan.ranks[r]
    c = rp.copies
    out["packs"] = (_rank(plan, r, copies=_table(c, COPY_COLUMNS, dst_offset=np.where(
        np.arange(len(c)) == b, c["dst_offset"][a], c["dst_offset"]))), r)
    out["roles"] = (_rank(plan, r, copies=_table(c, COPY_COLUMNS, dst_region=np.where(
        np.arange(len(c)) == a, 0, c["dst_region"]))), r)
    opts = dataclasses.replace(plan.header.options, max_write_bytes=int(w["nbytes"].max()) - 1)
    out["sizes"] = (dataclasses.replace(plan, header=dataclasses.replace(plan.header,
                                                                        options=opts)), 0)
    s = src.signals
    keep = s["kind"] != DONE
    out["signals"] = (_rank(plan, 0, signals=_table(s, SIGNAL_COLUMNS, **{
        n: s[n][keep] for n, _ in SIGNAL_COLUMNS})), 0)
    regs = list(rp.regions)
    regs[1] = dataclasses.replace(regs[1], name=regs[0].name)
    out["regions"] = (_rank(plan, r, regions=tuple(regs)), r)
    t = next(rp.rank for rp in shadowed.ranks if rp.role == "target")
    u = plan.ranks[t].copies
    shape = ("size0", "size1", "size2", "dst_stride0", "dst_stride1", "dst_stride2")
    rows = np.flatnonzero(u["kind"] == UNPACK)
    a, b = next((i, j) for i in rows for j in rows  # two of one box shape
                if i < j and all(u[n][i] == u[n][j] for n in shape))
    pick = np.arange(len(u)) == b  # b writes a's bytes too
    out["unpacks"] = (_rank(plan, t, copies=_table(u, COPY_COLUMNS, **{
        n: np.where(pick, u[n][a], u[n]) for n in ("dst_region", "dst_offset")})), t)
    out["shadow"] = (_rank(shadowed, t, shadow=_broken(shadowed.ranks[t])["overlap"].shadow), t)
    return out


@pytest.fixture(scope="module")
def plans() -> tuple[Plan, Plan]:
    return _compile(CASES[1]), _compile(CASES[0], "full")


def _load(plan: Plan, r: int) -> None:
    """The executor's load of rank `r` up to binding (no tensors given: a plan it accepts
    stops at the bind)."""
    Executor(plan.header, plan.ranks[r], {}, transport="local", rendezvous=Fabric(), timeout_s=2)


def test_the_compiled_plans_pass_verify_and_every_rank_loads_up_to_its_tensors(plans) -> None:
    for plan in plans:
        assert verify_plan(plan) == []
        for rp in plan.ranks:
            with pytest.raises(BindError):
                _load(plan, rp.rank)


@pytest.mark.parametrize("rule", ("bounds", *rankcheck.RULES))
def test_a_plan_breaking_a_rank_local_rule_is_refused_by_verify_and_by_load(plans, rule
                                                                             ) -> None:
    plan, r = _mutants(*plans)[rule]
    assert verify_plan(plan), f"verify passes a plan breaking {rule}"
    with pytest.raises(PlanBoundsError) as e:
        _load(plan, r)
    assert "\n" not in str(e.value) and f"rank {r}" in str(e.value)
    if rule in ("packs", "unpacks"):  # refused by that rule, not another
        assert f"{rule[:-1].upper()} " in str(e.value), e.value


def test_packs_are_judged_by_their_bytes_not_their_extents(plans) -> None:
    """Two PACKs of one stage write the left and the right half of every row of one staging
    block: their extents overlap, their bytes do not, and the rank loads (up to its tensors);
    moved one element left, they share a byte of each row and load refuses the rank."""
    plan = plans[0]
    r, (a, b) = _packer(plan)
    c = plan.ranks[r].copies
    assert int(c["dst_stride1"][a]) == 1 and int(c["size1"][a]) % 2 == 0
    half, rows = int(c["size1"][a]) // 2, int(c["size0"][a])
    base, pitch = int(c["dst_offset"][a]), int(c["dst_stride0"][a])

    def halves(right: int) -> Plan:
        pick = np.isin(np.arange(len(c)), (a, b))
        cols = {"size0": np.where(pick, rows, c["size0"]),
                "size1": np.where(pick, half, c["size1"]),
                "dst_stride0": np.where(pick, pitch, c["dst_stride0"]),
                "dst_offset": np.where(np.arange(len(c)) == b, base + right,
                                       np.where(pick, base, c["dst_offset"])),
                "src_stride0": np.where(pick, c["src_stride0"][a], c["src_stride0"]),
                "src_offset": np.where(pick, c["src_offset"][a], c["src_offset"]),
                "src_region": np.where(pick, c["src_region"][a], c["src_region"])}
        return _rank(plan, r, copies=_table(c, COPY_COLUMNS, **cols))

    apart, shared = halves(half), halves(half - 1)
    for p in (apart, shared):  # the extents overlap in both
        lo, hi = (int(c["dst_offset"][a]), int(p.ranks[r].copies["dst_offset"][b]))
        assert hi < lo + (rows - 1) * pitch + half
    assert list(rankcheck.packs(apart.ranks[r])) == []
    with pytest.raises(BindError):  # every check passed: it stops at the missing tensors
        _load(apart, r)
    (msg,) = rankcheck.packs(shared.ranks[r])
    assert f"writes byte {2 * (base + half - 1)}" in msg, msg  # bf16: 2 bytes
    with pytest.raises(PlanBoundsError, match=f"rank {r}: PACK"):
        _load(shared, r)
