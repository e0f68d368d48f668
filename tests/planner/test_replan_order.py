"""The replan's order of a rank's writes (`planner.replan_writes._packed`): the packed keys
sort as numpy's lexsort of (group, source region, target region, source offset, target
offset), whether the columns pack as they are or need an offset's rank among its values;
where even that does not fit in 63 bits, one line, not a wrong order."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner.errors import NotIncremental
from planner.replan_writes import _packed


@dataclasses.dataclass
class _Rank:
    rank: int
    regions: tuple[object, ...]


@pytest.mark.parametrize("widths,distinct", [
    ((3, 10, 0, 29), 7),  # packs as it is
    ((6, 10, 40, 31), 7),  # packs once the widest offset is ranked
    ((4, 8, 62, 62), 7),  # packs once both offsets are ranked
])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_keys_sort_as_lexsort(widths, distinct, seed):
    rng = np.random.default_rng(seed)
    n, regions = 5000, 3000
    group = rng.integers(0, 1 << widths[0], n) + (seed << 2)
    cols = [group, rng.integers(0, 40, n)]  # source regions: a few of the rank's
    for b in widths[1:]:  # values spread over `b` bits, some rows repeated
        values = rng.integers(0, 1 << b, distinct, dtype=np.int64) if b else np.zeros(
            1, np.int64)
        cols.append(values[rng.integers(0, len(values), n)] + (seed << 2))
    key, shift, bits = _packed(_Rank(0, (None,) * regions), cols)
    want = np.lexsort(cols[::-1])
    assert np.array_equal(np.argsort(key, kind="stable"), want)
    rows = np.stack(cols, 1)
    assert np.array_equal(key[1:] == key[:-1], (rows[1:] == rows[:-1]).all(1))
    # the source region sits at `shift`, wide enough for any region of the rank
    assert np.array_equal((key >> shift) & ((1 << bits) - 1), cols[1])
    assert bits >= (regions - 1).bit_length()


def test_packed_refuses_what_does_not_fit_in_one_line():
    rng = np.random.default_rng(0)
    n = 5000
    cols = [rng.integers(0, 1 << 20, n), rng.integers(0, 1000, n),
            rng.integers(0, 1 << 20, n), rng.integers(0, 1 << 40, n),
            rng.integers(0, 1 << 40, n)]  # even ranked: 20 + 10 + 20 + 13 + 13 bits
    with pytest.raises(NotIncremental, match="source rank 3.*63 bits.*compile the new "
                       "placement in full"):
        _packed(_Rank(3, (None,) * 1000), cols)
