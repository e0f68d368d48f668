"""A part whose regions or peer_regions equal those of a part decoded lately reuses that
part's tuples, and is still checked as a part never seen: the same values with a float or
a bool where an int was are refused. The bounds proof finds a write's peer and (peer,
region) by direct tables where they are small and by a sorted search elsewhere: both give
the same messages."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

import schemas.bounds as bounds_mod
from schemas.bounds import violations
from schemas.errors import PlanFormatError
from schemas.plan import WRITE_COLUMNS, RankPlan, Table, load_plan
from tests.property import fuzz


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return load_plan(fuzz.base_plans(str(tmp_path_factory.mktemp("seen")))["fp8"])


def _source(plan):
    return next(rp for rp in plan.ranks if rp.peer_regions and len(rp.writes))


def _raw(rp: RankPlan) -> dict:
    """The part as a reader decodes it from the file (bytes columns, lists)."""
    return msgpack.unpackb(msgpack.packb(rp.encode()), raw=False)


def test_an_equal_part_reuses_the_decoded_tuples(plan):
    rp = _source(plan)
    a, b = RankPlan.decode(_raw(rp)), RankPlan.decode(_raw(rp))
    assert a.regions == rp.regions and a.peer_regions == rp.peer_regions
    assert b.regions is a.regions and b.peer_regions is a.peer_regions


_WHERE = {"region bytes": lambda raw: (raw["regions"][0], 3),
          "region shape": lambda raw: (raw["regions"][0][2], 0),
          "peer": lambda raw: (raw["peer_regions"][0], 0),
          "peer region": lambda raw: (raw["peer_regions"][0][1][0], 0),
          "peer bytes": lambda raw: (raw["peer_regions"][0][1][0], 1)}


@pytest.mark.parametrize("where", sorted(_WHERE))
@pytest.mark.parametrize("value", ["float", "bool"])
def test_a_float_or_bool_where_an_int_was_is_refused_after_a_twin_was_read(plan, where, value):
    rp = _source(plan)
    twin, raw = _raw(rp), _raw(rp)
    row, i = _WHERE[where](twin)
    if value == "bool":
        row[i] = 1  # the twin holds an int 1 there, the part True: equal in Python
    RankPlan.decode(twin)  # its lists are now the ones decoded lately
    row, i = _WHERE[where](raw)
    row[i] = True if value == "bool" else float(row[i])
    assert raw == twin
    with pytest.raises(PlanFormatError, match="not an integer in range"):
        RankPlan.decode(raw)


def _with_write(rp, **values):
    cols = {n: np.array(rp.writes[n]) for n, _ in WRITE_COLUMNS}
    for k, v in values.items():
        cols[k][0] = v
    return dataclasses.replace(rp, writes=Table.build(WRITE_COLUMNS, **cols))


@pytest.mark.parametrize("direct", [bounds_mod._DIRECT, 0])
def test_peer_lookups_name_the_same_write_by_table_or_search(plan, monkeypatch, direct):
    monkeypatch.setattr(bounds_mod, "_DIRECT", direct)
    rp = _source(plan)
    assert next(violations(rp), None) is None
    peer = int(rp.writes["dst_rank"][0])
    listed = dict(dict(rp.peer_regions)[peer])
    unlisted = next(r for r in range(len(listed) + 1) if r not in listed)
    msg = next(violations(_with_write(rp, dst_region=unlisted)), None)
    assert msg is not None and msg.startswith(f"rank {rp.rank}: write op 0 names a dst region "
                                              f"of rank {peer} that peer_regions does not list")
    reg = int(rp.writes["dst_region"][0])
    end = listed[reg] - int(rp.writes["nbytes"][0]) + 1  # one byte past the region's end
    msg = next(violations(_with_write(rp, dst_offset=end)), None)
    assert msg is not None and msg.startswith(f"rank {rp.rank}: write op 0 writes past the end "
                                              f"of its dst region on rank {peer}")
    stranger = next(p for p in range(len(plan.ranks) + 1)
                    if p != rp.rank and p not in dict(rp.peer_regions))
    msg = next(violations(_with_write(rp, dst_rank=stranger)), None)
    assert msg is not None and "writes to a rank missing from peer_regions" in msg
