"""`explain.explain_table` and `explain.explain_with`: bytes and boxes per (tensor, source
region, target region), sorted, equal to summing the rows in a dict."""

from __future__ import annotations

import numpy as np

from planner.passes.explain import explain_table, explain_with


def _oracle(rows: np.ndarray) -> list[tuple[int, ...]]:
    out: dict[tuple[int, ...], list[int]] = {}
    for *key, nbytes in rows.tolist():
        acc = out.setdefault(tuple(key), [0, 0])
        acc[0] += nbytes
        acc[1] += 1
    return [(*k, *v) for k, v in sorted(out.items())]


def _rows(table) -> list[tuple[int, ...]]:
    return [tuple(r) for r in np.stack([np.asarray(c, np.int64) for c in table.columns],
                                       axis=1).tolist()]


def test_sums_equal_rows_in_key_order() -> None:
    rng = np.random.default_rng(7)
    rows = np.stack([rng.integers(0, 9, 3000), rng.integers(0, 4, 3000),
                     rng.integers(0, 3, 3000), rng.integers(4, 8, 3000),
                     rng.integers(0, 2, 3000), rng.integers(1, 1 << 40, 3000)], axis=1)
    rows[100:140] = rows[100]  # a run of equal rows (a chunk cut in parts)
    assert _rows(explain_table(*rows.T)) == _oracle(rows)
    # more rows added to a table already summed: as if summed together
    assert _rows(explain_with(explain_table(*rows[:1700].T), rows[1700:])) == _oracle(rows)
    assert len(explain_table(*rows[:0].T)) == 0


def _replicated(rng: np.random.Generator, replicas: int, shift: int) -> np.ndarray:
    """Rows of `replicas` blocks alike: one block's rows (target ranks 40..47), repeated
    with the target ranks moved by `r * shift` in block r."""
    n = 2000
    one = np.stack([rng.integers(0, 9, n), rng.integers(0, 4, n), rng.integers(0, 3, n),
                    rng.integers(40, 48, n), rng.integers(0, 2, n),
                    rng.integers(1, 1 << 40, n)], axis=1)
    one[100:140] = one[100]  # a run of equal rows (a chunk cut in parts)
    blocks = [one.copy() for _ in range(replicas)]
    for r, b in enumerate(blocks):
        b[:, 3] += r * shift
    return np.concatenate(blocks)


def test_replica_blocks_give_the_table_of_all_rows(monkeypatch) -> None:
    """Rows that are a target engine's replicas fed alike: the table made from the first
    block alone (only its rows are sorted) and repeated is the table of all the rows; rows
    that are not (a block differs, blocks of overlapping ranks, a length not a multiple)
    are all sorted and summed as they are."""
    import planner.passes.explain as explain

    sorted_rows: list[int] = []
    real = explain._explain
    monkeypatch.setattr(explain, "_explain",
                        lambda *c: sorted_rows.append(len(c[0])) or real(*c))
    rng = np.random.default_rng(11)
    rows = _replicated(rng, 4, 8)
    assert _rows(explain_table(*rows.T, replicas=4)) == _oracle(rows)
    assert sorted_rows == [len(rows) // 4]
    other = rows.copy()
    other[-3, 5] += 1  # one block's bytes differ
    for bad in (other, _replicated(rng, 4, 5), rows[:-1]):
        sorted_rows.clear()
        assert _rows(explain_table(*bad.T, replicas=4)) == _oracle(bad)
        assert sorted_rows == [len(bad)]


def test_spilled_table_reads_the_same() -> None:
    """`spilled`: the table's columns from a mapped temporary file, equal and read-only."""
    from planner.passes.explain import spilled

    rng = np.random.default_rng(3)
    rows = np.stack([rng.integers(0, 9, 500), rng.integers(0, 4, 500), rng.integers(0, 3, 500),
                     rng.integers(4, 8, 500), rng.integers(0, 2, 500),
                     rng.integers(1, 1 << 40, 500)], axis=1)
    table = explain_table(*rows.T)
    out = spilled(table)
    assert out.schema == table.schema and _rows(out) == _rows(table)
    assert not any(c.flags.writeable for c in out.columns)
    empty = explain_table(*np.zeros((6, 0), np.int64))
    assert spilled(empty) is empty


def test_rows_are_asked_for_one_block_at_a_time() -> None:
    """`explain_rows`: replica blocks alike are made (and checked) one block at a time, the
    table the same as from all the rows; blocks not alike are then made whole."""
    from planner.passes.explain import explain_rows

    rng = np.random.default_rng(5)
    rows = _replicated(rng, 8, 8)
    asked: list[int] = []

    def get(at: slice) -> tuple[np.ndarray, ...]:
        asked.append(len(rows[at]))
        return tuple(rows[at].T)

    for spill in (False, True):
        asked.clear()
        assert _rows(explain_rows(get, len(rows), 8, spill)) == _oracle(rows)
        assert asked == [len(rows) // 8] * 8  # each block once (the first kept, not remade)
    rows[-1, 5] += 1  # the last block differs: every row, as it is
    asked.clear()
    assert _rows(explain_rows(get, len(rows), 8)) == _oracle(rows)
    assert asked[-1] == len(rows)


def test_stamped_columns_made_in_pieces(monkeypatch) -> None:
    """Replica blocks alike: the table's columns made `STAMP_ROWS` rows at a time (pieces
    that do not divide the rows, each written or copied before the next overwrites its
    buffer) are the table of all the rows, in the schema's dtypes, spilled or not."""
    import planner.passes.explain as explain

    rng = np.random.default_rng(13)
    rows = _replicated(rng, 8, 8)
    for step in (333, 1, len(rows), 1 << 20):
        monkeypatch.setattr(explain, "STAMP_ROWS", step)
        for spill in (False, True):
            table = explain.explain_rows(lambda at: tuple(rows[at].T), len(rows), 8, spill)
            assert _rows(table) == _oracle(rows)
            assert [c.dtype.str for c in table.columns] == [d for _, d in table.schema]
