"""`gather_out.Block`: rows appended one at a time and as arrays, in order, as one int64
array, kept as the block's only part (never held twice), or taken out of it
(`take`); `gather_out.Rows`: a table's
columns as lists, each made on its first read only."""

from __future__ import annotations

import numpy as np

from planner.passes.gather_out import Block, Rows
from planner.passes.intersect import PieceTable


def test_rows_in_order_as_one_array_kept_once() -> None:
    b = Block(3)
    b.append((1, 2, 3))
    b.extend(np.array([[4, 5, 6], [7, 8, 9]], dtype=np.int32))
    b.append((10, 11, 12))
    b.extend(np.arange(6, dtype=np.int64).reshape(2, 3))
    want = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [0, 1, 2], [3, 4, 5]]
    got = b.array()
    assert got.dtype == np.int64 and got.tolist() == want and len(b) == len(want)
    assert b.blocks == [got] and b.array() is got  # the parts dropped; asked again, the same
    view = np.arange(12, dtype=np.int64).reshape(4, 3)[1:]
    one = Block(3)
    one.extend(view)  # a view of another array: copied, so changes to it stay its own
    assert one.array() is not view and one.array().base is None
    assert one.array().tolist() == view.tolist()
    small = Block(3)
    small.extend(np.ones((2, 3), dtype=np.int32))
    assert small.array().dtype == np.int64
    assert Block(2).array().shape == (0, 2)


def test_take_moves_the_rows_out_with_room_for_more() -> None:
    b = Block(2)
    b.append((1, 2))
    b.extend(np.array([[3, 4], [5, 6]], dtype=np.int32))
    b.append((7, 8))
    got = b.take(3)
    assert got.dtype == np.int64 and got.shape == (7, 2)
    assert got[:4].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert len(b) == 0 and b.blocks == [] and b.tail == []  # emptied: the rows held once
    assert b.take().shape == (0, 2)


def test_rows_made_on_first_read_only() -> None:
    cols = {f: np.arange(5, dtype=np.int32) * (i + 1) for i, f in enumerate(PieceTable.__slots__)}
    rows = Rows(PieceTable(**cols), ("rank", "base", "a0"))
    assert "rank" not in vars(rows) and "base" not in vars(rows)
    assert rows.rank == cols["rank"].tolist() and type(rows.rank[0]) is int
    assert rows.rank is rows.rank and "rank" in vars(rows)  # made once, then kept
    assert "base" not in vars(rows) and "a0" not in vars(rows)  # never read: never made
    for name in ("dtype", "_x", "nope"):  # not among its columns
        try:
            getattr(rows, name)
        except AttributeError:
            continue
        raise AssertionError(name)


def test_claim_gives_rows_to_fill_in_order() -> None:
    b = Block(2)
    b.reserve(4)
    b.append((0, 0))
    into = b.claim(2)  # in the reserved rows: filled in place, never copied
    into[:] = [[1, 1], [2, 2]]
    past = b.claim(3)  # past the room: an array of its own
    past[:] = [[3, 3], [4, 4], [5, 5]]
    assert len(b) == 6
    assert b.take().tolist() == [[i, i] for i in range(6)]
    plain = Block(2)  # no room at all
    plain.claim(1)[:] = 7
    assert plain.array().tolist() == [[7, 7]]


def test_max_at_is_maximum_at() -> None:
    from planner.passes.gather_out import _max_at

    rng = np.random.default_rng(0)
    for n in (0, 1, 50, 1000):
        at = np.sort(rng.integers(0, 9, n))  # runs of one key, as `_halves` has them
        at[: n // 3] = rng.integers(0, 9, n // 3)  # and keys in no order
        values = rng.integers(0, 10**12, n)
        want, got = np.zeros(9, dtype=np.int64), np.zeros(9, dtype=np.int64)
        np.maximum.at(want, at, values)
        _max_at(got, at, values)
        assert got.tolist() == want.tolist()
