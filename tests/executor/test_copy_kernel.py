"""The batched copy kernel (`executor/transports/copy_kernel.py`): its piece table on any
machine (pieces cover every write once, in order, keep its alignment), and on a GPU the
kernel itself, bit-exact for aligned, alike-misaligned and differently misaligned writes,
launched directly and replayed from a CUDA graph (`pytest -m gpu`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.gpu.copy_kernel import CopyKernel, piece_table


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20),
                          st.integers(0, 5000)), max_size=30),
       st.sampled_from([16, 48, 1024]))
def test_pieces_cover_each_write_once_and_keep_its_alignment(writes, chunk):
    dst = np.array([w[0] for w in writes], dtype=np.int64)
    src = np.array([w[1] for w in writes], dtype=np.int64)
    n = np.array([w[2] for w in writes], dtype=np.int64)
    rows = piece_table(dst, src, n, chunk)
    assert rows.dtype == np.int64 and rows.shape[1] == 3
    assert (rows[:, 2] > 0).all() and (rows[:, 2] <= chunk).all()
    at = 0
    for d, s, size in zip(dst.tolist(), src.tolist(), n.tolist()):
        done = 0
        while done < size:  # the pieces of one write, in order, back to back
            pd, ps, pn = rows[at].tolist()
            assert (pd - d, ps - s) == (done, done) and done % 16 == 0
            done += pn
            at += 1
        assert done == size
    assert at == len(rows)


def test_pieces_move_the_bytes_a_plain_copy_would():
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    want, got = buf.copy(), buf.copy()
    src = np.array([0, 3000, 9001, 20000], dtype=np.int64)
    dst = np.array([40000, 50003, 45000, 60000], dtype=np.int64)
    n = np.array([2500, 777, 4000, 0], dtype=np.int64)
    for d, s, size in zip(dst, src, n):
        want[d:d + size] = buf[s:s + size]
    for d, s, size in piece_table(dst, src, n, 256).tolist():
        got[d:d + size] = buf[s:s + size]
    assert np.array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graph,share", [(False, 1.0), (True, 1.0), (True, 0.25), (False, 0.0)])
def test_kernel_copies_bit_exact(graph, share):
    # share: the grid's share of the device (`beside_packs_kernel_share`); 0: one block
    dev = torch.device("cuda", 0)
    kernel = CopyKernel.load(dev)
    assert kernel is not None, "the copy kernel did not build (NVRTC?)"
    g = torch.Generator(device=dev).manual_seed(3)
    src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, device=dev, generator=g)
    dst = torch.zeros(8 << 20, dtype=torch.uint8, device=dev)
    # (dst offset, src offset, bytes): aligned, alike-misaligned (head and tail), misaligned
    # differently (byte path), tiny, one byte, several pieces, one not a multiple of 16
    cases = [(0, 0, 1 << 20), (1 << 20 | 3, 5 << 20 | 3, 300_001), (3 << 20 | 1, 6 << 20 | 2,
             70_000), (4 << 20, 7 << 20, 5), (4 << 20 | 64, 7 << 20 | 9, 1),
             (5 << 20, 2 << 20, 1_500_000), (7 << 20, 8, 1000)]
    d = np.array([dst.data_ptr() + c[0] for c in cases], dtype=np.int64)
    s = np.array([src.data_ptr() + c[1] for c in cases], dtype=np.int64)
    n = np.array([c[2] for c in cases], dtype=np.int64)
    table = kernel.table(d, s, n)
    if graph:
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            kernel.launch(table, share)
        cg.replay()
    else:
        kernel.launch(table, share)
    want = torch.zeros_like(dst)
    for do, so, size in cases:
        want[do:do + size] = src[so:so + size]
    torch.cuda.synchronize(dev)
    assert torch.equal(dst, want)


def test_batch_copies_merge_adjacent_writes_only_within_an_allocation():
    from executor.transports.base import WriteBatch, batch_copies
    src = [torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)]
    dst = [torch.zeros(64, dtype=torch.uint8)]
    a = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    # writes 0 and 1 adjacent on both sides; write 2 empty; write 3 from the other region
    batch = WriteBatch(1, a(0, 0, 0, 1), a(0, 8, 16, 0), a(0, 0, 0, 0), a(0, 8, 40, 16),
                       a(8, 8, 0, 4))
    s0, s1, d0 = (t.data_ptr() for t in (*src, dst[0]))
    d, s, n = batch_copies(src, dst, batch)
    assert (d.tolist(), s.tolist(), n.tolist()) == ([d0, d0 + 16], [s0, s1], [16, 4])
    alloc = a(0, 1)  # the two writes of region 0 in one allocation: still merged
    d, s, n = batch_copies(src, dst, batch, alloc, a(0))
    assert n.tolist() == [16, 4]
    batch2 = WriteBatch(1, a(0, 1), a(56, 0), a(0, 0), a(0, 8), a(8, 8))
    if s1 == s0 + 64:  # adjacent in memory, but two allocations: merged for the kernel only
        assert batch_copies(src, dst, batch2)[2].tolist() == [16]
    assert batch_copies(src, dst, batch2, a(s0, s1), a(d0))[2].tolist() == [8, 8]
