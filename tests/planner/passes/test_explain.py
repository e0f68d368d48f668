"""`emit.explain_table` and `emit.explain_with`: bytes and boxes per (tensor, source
region, target region), sorted, equal to summing the rows in a dict."""

from __future__ import annotations

import numpy as np

from planner.passes.emit import explain_table, explain_with


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


def test_spilled_table_reads_the_same() -> None:
    """`spilled`: the table's columns from a mapped temporary file, equal and read-only."""
    from planner.passes.emit import spilled

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
