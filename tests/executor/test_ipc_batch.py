"""`cuda_runtime.BatchCopies`: a batch's copies split into growing `cuMemcpyBatchAsync`
calls (the link starts after the first few are queued), every copy once, in order, and the
first failing call's code returned. The driver function here records its calls; the GPU
path runs in `tests/executor/test_cuda_ipc.py` (two or more GPUs)."""

from __future__ import annotations

import ctypes

import pytest

from executor.gpu.cuda_runtime import BatchCopies


class Recorder:
    """Stands in for the driver's entry point: records each call's copies."""

    def __init__(self, fail_at: int = -1) -> None:
        self.calls: list[tuple[list[int], list[int], list[int], int]] = []
        self.fail_at = fail_at

    def __call__(self, d, s, n, count, attrs, idx, num_attrs, *rest) -> int:
        self.calls.append((list(d[:count]), list(s[:count]), list(n[:count]), len(rest)))
        return 1 if len(self.calls) - 1 == self.fail_at else 0


@pytest.mark.parametrize("count,first,most,sizes", [
    (0, 4, 128, []),
    (3, 4, 128, [3]),
    (64, 4, 128, [4, 8, 16, 32, 4]),
    (1000, 4, 128, [4, 8, 16, 32, 64] + [128] * 6 + [108]),
    (300, 1000, 128, [300]),  # first over the batch: one call
])
def test_calls_grow_and_keep_every_copy_once(count, first, most, sizes):
    rec = Recorder()
    api = BatchCopies(rec, with_fail_index=False)
    dst, src = [1000 + 16 * i for i in range(count)], [5000 + 16 * i for i in range(count)]
    nbytes = [16 + i for i in range(count)]
    assert api.post(api.prepare(dst, src, nbytes, first, most), stream=7) == 0
    assert [len(c[0]) for c in rec.calls] == sizes
    assert [x for c in rec.calls for x in c[0]] == dst
    assert [x for c in rec.calls for x in c[1]] == src
    assert [x for c in rec.calls for x in c[2]] == nbytes
    assert all(c[3] == 1 for c in rec.calls)  # only the stream after the attributes


def test_old_entry_point_gets_the_fail_index_and_a_failure_stops_the_post():
    rec = Recorder(fail_at=1)
    api = BatchCopies(rec, with_fail_index=True)
    calls = api.prepare(list(range(0, 160, 16)), list(range(0, 160, 16)), [16] * 10, 2, 8)
    assert api.post(calls, stream=0) == 1
    assert len(rec.calls) == 2 and all(c[3] == 2 for c in rec.calls)  # fail index, stream


def test_attributes_are_the_drivers_layout():
    assert ctypes.sizeof(BatchCopies(Recorder(), False).attrs) == 24
    assert BatchCopies(Recorder(), False).attrs.src_access_order == 1  # in stream order
