"""The replan's order of a rank's writes (`planner.replan_writes._packed`): the packed keys
sort as numpy's lexsort of (group, source region, target region, source offset, target
offset), whether the columns pack as they are or need an offset's rank among its values;
where even that does not fit in 63 bits, one line, not a wrong order."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner.errors import NotIncremental
from planner.replan_writes import (
    _check_cuts,
    _merged,
    _packed,
    _places,
    _spliced,
    _windows,
)


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


@pytest.mark.parametrize("share,near", [(0.01, True), (0.01, False), (0.3, False),
                                        (1.0, False)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_moved_entries_merge_as_a_sort_of_the_new_keys(share, near, seed):
    """A placement's moved entries put back among the others (`_places`, then `_windows`:
    only the spans between each one's old and new place) give the order a stable sort of
    every entry's new key gives; entries moved near their place touch a few spans only."""
    rng = np.random.default_rng(seed)
    key = np.unique(rng.integers(0, 1 << 20, 4000)) * 2  # (even: a key + 1 is no key)
    n = len(key)
    mi = np.sort(rng.choice(n, max(1, int(share * n)), replace=False))
    new = key.copy()
    if near:  # just past a neighbour a few entries away
        to = key[np.clip(mi + rng.integers(-3, 4, len(mi)), 0, n - 1)] + 1
        _, first = np.unique(to, return_index=True)
        mi, to = mi[np.sort(first)], to[np.sort(first)]
        new[mi] = to
    else:  # anywhere, distinct, equal to no staying entry's key
        new[mi] = rng.choice(np.arange(1, 1 << 21, 2), len(mi), replace=False)
    order = np.argsort(new[mi], kind="stable")
    moved = np.zeros(n, bool)
    moved[mi] = True
    put = _places(key, mi, new[mi][order], moved)
    assert put is not None
    win, entry, here = _windows(mi[order], put)
    got = np.arange(n)
    got[win] = entry
    want = np.argsort(new, kind="stable")
    assert np.array_equal(got, want)
    assert np.array_equal(entry[here], mi[order])
    if near:
        assert len(win) <= 8 * len(mi)
    for way in (_merged(key, moved, mi[order], new[mi][order]),  # (many moved)
                _spliced(key, moved, mi, mi[order], new[mi][order])):  # (a few)
        win, entry, keys = way
        got = np.arange(n)
        got[win] = entry
        assert np.array_equal(got, want) and np.array_equal(keys, new[entry])


def test_a_moved_key_equal_to_a_staying_entry_s_is_found():
    key = np.array([10, 20, 30, 40, 50], np.int64)
    moved = np.array([0, 1, 0, 0, 0], bool)
    assert _places(key, np.array([1]), np.array([40]), moved) is None  # entry 3 stays: the
    # same target bytes twice in one group
    for way in (_merged(key, moved, np.array([1]), np.array([40])),
                _spliced(key, moved, np.array([1]), np.array([1]), np.array([40]))):
        assert way is None
    moved[3] = True
    assert _places(key, np.array([1, 3]), np.array([40, 45]), moved) is not None  # it moves
    for way in (_merged(key, moved, np.array([1, 3]), np.array([40, 40])),  # two moved keys
                _spliced(key, moved, np.array([1, 3]), np.array([1, 3]), np.array([40, 40]))):
        assert way is None  # equal


@dataclasses.dataclass
class _Writes:
    rank: int
    writes: dict[str, np.ndarray]


def test_writes_of_unequal_sizes_reordered_across_a_cut_are_refused():
    """A group's writes reordered: where sizes differ and a batch cut (`max_write_bytes`)
    falls between them, one line; where they stay within the same rounds, nothing."""
    nbytes = np.array([4, 4, 4, 8, 4, 4], np.int64)
    rp = _Writes(1, {"nbytes": nbytes, "dst_rank": np.full(6, 5, np.int32)})
    at = np.arange(6)
    first = np.zeros(6, bool)
    first[0] = True
    swap = (np.array([3, 4]), np.array([4, 3]))  # the 8-byte write and the next swap places
    perm = at.copy()  # (the row at each position: given where most writes move)
    perm[swap[0]] = swap[1]
    # (places None: each entry at its index, as a table in order)
    for places, whole in ((at, None), (None, None), (at, perm)):
        args = (rp, places, *swap, at[swap[0]], at[swap[1]], first)
        _check_cuts(*args, 1 << 20, 2, whole)  # one round: no cut moves
        with pytest.raises(NotIncremental, match="source rank 1's batches to target rank 3 "
                           "change their cut.*compile the new placement in full"):
            _check_cuts(*args, 10, 2, whole)
