"""`nic_stats.egress_sets`: the direct path's bytes per set of source NICs holding them (only
chunks with no holder on their target's host), the sets in the order the source boxes first
hold them, against a dict built box by box in Python."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from planner.nic_stats import egress_sets
from planner.passes.intersect import Chunks, PieceTable
from schemas.protocol import ITEM


def _oracle(ptr: list[int], holders: list[int], sbox: list[int], dst_rank: list[int],
            nbytes: list[int], host: list[int], nic: list[int], src_rank: list[int]
            ) -> list[tuple[tuple[int, ...], float]]:
    keys: dict[tuple[int, ...], float] = {}
    for b in range(len(ptr) - 1):  # every box's set, in box order
        keys.setdefault(tuple(sorted({nic[src_rank[h]] for h in holders[ptr[b]:ptr[b + 1]]})),
                        0.0)
    for s, d, nb in zip(sbox, dst_rank, nbytes):
        hs = holders[ptr[s]:ptr[s + 1]]
        if all(host[src_rank[h]] != host[d] for h in hs):
            keys[tuple(sorted({nic[src_rank[h]] for h in hs}))] += nb
    return [(k, v) for k, v in keys.items() if v > 0]


def test_bytes_per_holder_set_in_first_held_order() -> None:
    rng = np.random.default_rng(5)
    world, sources = 32, 16
    host = (np.arange(world) // 4).tolist()  # 4 ranks a host
    nic = (np.arange(world) // 2).tolist()  # 2 ranks a NIC: holders may share one
    n_box, n_src_rows = 300, 600
    src_rank = rng.integers(0, sources, n_src_rows)
    counts = rng.choice([0, 1, 1, 1, 2, 3, 5], n_box)  # boxes of no, one, several holders
    ptr = np.concatenate([[0], np.cumsum(counts)])
    holders = rng.integers(0, n_src_rows, int(ptr[-1]))
    n = 2000
    sbox = rng.integers(0, n_box, n)
    dst = np.arange(n)
    dst_rank = rng.integers(sources, world, n)
    size0, size1 = rng.integers(1, 50, n), rng.integers(1, 50, n)
    z = np.zeros(n, dtype=np.int64)
    dtype = np.zeros(n, dtype=np.int64)
    dst_table = PieceTable(rank=dst_rank, region=z, tensor=z, off0=z, off1=z, size0=size0,
                           size1=size1, base=z, a0=z, a1=z, dtype=dtype)
    zs = np.zeros(n_src_rows, dtype=np.int64)
    src_table = PieceTable(rank=src_rank, region=zs, tensor=zs, off0=zs, off1=zs, size0=zs,
                           size1=zs, base=zs, a0=zs, a1=zs, dtype=zs)
    chunks = Chunks(tensor=z, off0=z, off1=z, size0=size0, size1=size1, dst=dst, sbox=sbox,
                    holder_ptr=ptr, holders=holders)
    topo = SimpleNamespace(host=host, nic=nic)
    got = egress_sets(chunks, src_table, dst_table, topo)  # type: ignore[arg-type]
    item = int(ITEM[0])
    want = _oracle(ptr.tolist(), holders.tolist(), sbox.tolist(), dst_rank.tolist(),
                   (size0 * size1 * item).tolist(), host, nic, src_rank.tolist())
    assert list(got.items()) == want
    assert any(len(k) > 1 for k, _ in want) and any(len(k) == 1 for k, _ in want)


def test_sums_from_rank_pairs_equal_the_block_sums(monkeypatch) -> None:
    """`nic_stats`' NIC and NVLink bytes and `emit.rank_stats` from the writes' sums per rank
    pair (`pair_bytes`) equal those summed from the write columns (the path of a world too
    large for the pair table)."""
    import planner.rows as rows
    from planner.nic_stats import _sums, pair_bytes
    from planner.passes.emit import rank_stats

    rng = np.random.default_rng(8)
    world, n = 24, 5000
    topo = SimpleNamespace(host=(np.arange(world) // 4).tolist(),
                           nic=(np.arange(world) // 2).tolist(), world=world)
    low = SimpleNamespace(w_src_rank=rng.integers(0, world, n).astype(np.int32),
                          w_dst_rank=rng.integers(0, world, n).astype(np.int32),
                          w_nbytes=rng.integers(1, 1 << 34, n),
                          copies={"kind": rng.integers(0, 4, 50).astype(np.uint8),
                                  "rank": rng.integers(0, world, 50)},
                          staging=rng.integers(0, 100, world))
    pairs = pair_bytes(topo, low)  # type: ignore[arg-type]
    assert pairs is not None
    got = _sums(topo, low, pairs)  # type: ignore[arg-type]
    stats = rank_stats(low, world, pairs)  # type: ignore[arg-type]
    monkeypatch.setattr(rows, "PAIR_BINS", 0)  # no pair table: the columns summed
    assert pair_bytes(topo, low) is None  # type: ignore[arg-type]
    want = _sums(topo, low)  # type: ignore[arg-type]
    for g, w in zip(got, want):
        assert g.shape == w.shape and (g == w).all()
    assert got[0].sum() > 0 and got[2].sum() > 0  # both remote and NVLink bytes
    assert stats == rank_stats(low, world)  # type: ignore[arg-type]
