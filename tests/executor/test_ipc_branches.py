"""`cuda_ipc.branches`: a stage's copies split into parallel branches of near-equal bytes
(no GPU needed: it only plans the split)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from executor.transports.cuda_ipc import branches

copies = st.lists(st.integers(1, 1 << 26), min_size=0, max_size=64)


@given(copies, st.integers(1, 8))
def test_branches_keep_every_copy_once_and_balance_bytes(sizes, k):
    raw = [(i * 10, i * 100, n) for i, n in enumerate(sizes)]
    parts = branches(raw, k)
    assert sorted(c for p in parts for c in p) == sorted(raw)
    assert len(parts) <= k and all(parts)
    if parts:
        loads = [sum(n for *_, n in p) for p in parts]
        assert max(loads) - min(loads) <= max(sizes)  # greedy: within one copy


def test_equal_copies_spread_evenly():
    raw = [(i, i, 1 << 20) for i in range(64)]
    assert [len(p) for p in branches(raw, 4)] == [16, 16, 16, 16]
