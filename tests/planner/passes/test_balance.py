"""`planner/passes/balance.py`: which staged chunks over NVLink go direct after all.

Target rank 2 unpacks four chunks of half rows (256 rows of 128 bf16, 64 KiB each) from
sources 0 and 1: two into region 5, two into region 6, so two copy ops of 10 us plus
128 KiB at 2000 Gb/s (0.52 us) each, 21.05 us of copies. As row writes an op is 512 rows
of 20 ns of NVLink time (10.24 us: the copy kernel's cost, `NVLINK_WRITE_S`), 256 of them
through each source; at the copy engines' cost (3.5 us a row, passed in) no op moves."""

from __future__ import annotations

import numpy as np
import pytest

from planner.passes.balance import direct_after_all
from planner.topology import NVLINK_WRITE_S
from schemas.config import Options

OPTS = Options()
ENGINES_WRITE_S = 3.5e-6
"""A peer write through the copy engines between two H100s (BENCHMARKS.md)."""
RANK = np.array([2, 2, 2, 2])
REGION = np.array([5, 5, 6, 6])
ROWS = np.full(4, 256)
NBYTES = np.full(4, 64 << 10)
PEER = np.array([0, 1, 0, 1])
COPY_S = np.array([0.0, 0.0, 2 * (10e-6 + (128 << 10) / 250e9)])


@pytest.mark.parametrize("link_us,movable,moved", [
    # links idle: the first op goes to rows (copies left 10.5 us >= links 10.24 us);
    # the second would leave no copies behind 20.5 us of rows: it stays
    ((0, 0, 0), (1, 1, 1, 1), (1, 1, 0, 0)),
    # the target's link already busy 5 us: rows would outlast the copy left, none move
    ((0, 0, 5), (1, 1, 1, 1), (0, 0, 0, 0)),
    # a source's link busy 8 us: its 5.12 us of rows would outlast the copy left
    ((8, 0, 0), (1, 1, 1, 1), (0, 0, 0, 0)),
    # region 5 has a chunk rows cannot write (over a NIC, or a strided row): region 6 goes
    ((0, 0, 0), (1, 0, 1, 1), (0, 0, 1, 1)),
    # a plan of real size: links busy for milliseconds, copies stay
    ((1000, 1000, 1000), (1, 1, 1, 1), (0, 0, 0, 0)),
])
def test_ops_move_while_the_copies_left_outlast_the_links(link_us, movable, moved) -> None:
    got = direct_after_all(RANK, REGION, ROWS, NBYTES, PEER, np.array(movable, dtype=bool),
                           COPY_S, np.array(link_us) * 1e-6, OPTS, row_write_s=20e-9)
    assert got.tolist() == [bool(m) for m in moved]


def test_no_op_moves_at_the_copy_engines_cost_a_row() -> None:
    # 512 rows of 3.5 us outlast any copy op of the geometry
    got = direct_after_all(RANK, REGION, ROWS, NBYTES, PEER, np.ones(4, dtype=bool), COPY_S,
                           np.zeros(3), OPTS, row_write_s=ENGINES_WRITE_S)
    assert not got.any()


def test_the_default_row_cost_is_the_copy_kernels() -> None:
    assert NVLINK_WRITE_S < 1e-7  # cuda_ipc's kernel writes over NVLink between GPUs
    got = direct_after_all(RANK, REGION, ROWS, NBYTES, PEER, np.ones(4, dtype=bool), COPY_S,
                           np.zeros(3), OPTS)
    assert got.any()
