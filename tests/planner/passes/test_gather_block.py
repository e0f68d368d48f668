"""`gather_out.Block`: rows appended one at a time and as arrays, in order, as one int64
array, kept as the block's only part (never held twice)."""

from __future__ import annotations

import numpy as np

from planner.passes.gather_out import Block


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
