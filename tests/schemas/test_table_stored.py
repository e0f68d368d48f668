"""A table's columns in their stored forms (`schemas/table.py`): raw bytes or a narrower
integer width (a column of one value too: no form repeats a value over rows it does not
store); every form decodes to the same table, and a malformed stored
column is refused in one line naming it."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from schemas.errors import PlanFormatError
from schemas.plan import COPY_COLUMNS, WRITE_COLUMNS
from schemas.table import Table

SCHEMA = (("kind", "<u1"), ("a", "<i4"), ("b", "<i8"), ("c", "<i8"), ("d", "<i8"))


def _round_trip(t: Table) -> Table:
    raw = msgpack.unpackb(msgpack.packb(t.stored(), use_bin_type=True), raw=False)
    return Table.from_msgpack(t.schema, raw, "t")


def _same(a: Table, b: Table) -> None:
    assert a.schema == b.schema
    for (name, dt), x, y in zip(a.schema, a.columns, b.columns):
        assert x.dtype == y.dtype == np.dtype(dt) and np.array_equal(x, y), name


def test_each_form_decodes_to_the_same_table() -> None:
    rng = np.random.default_rng(5)
    for n in (0, 1, 2, 1000):
        t = Table.build(SCHEMA, kind=rng.integers(0, 4, n), a=np.full(n, -7),
                        b=rng.integers(-100, 100, n), c=rng.integers(0, 1 << 40, n),
                        d=np.full(n, 1 << 40))
        _same(_round_trip(t), t)
        if n > 1:
            kind, a, b, c, d = t.stored()
            assert isinstance(kind, memoryview)  # one byte a row already
            assert a[0] == "i1" and len(a[1]) == n  # one value: narrowed, every row stored
            assert b[0] == "i1" and len(b[1]) == n  # int64 values of one byte
            assert isinstance(c, memoryview) and isinstance(d, memoryview)  # past int32: raw


def test_a_decoded_table_is_at_most_eight_times_its_stored_bytes() -> None:
    """Every row of every column is stored (one value over all rows too), at least a byte
    a value: a table's decoded bytes are at most 8x its stored columns' bytes."""
    t = Table.build((("x", "<i8"), ("y", "<i8")), x=np.full(9, 3), y=np.full(9, 3))
    x, y = t.stored()
    assert x[0] == y[0] == "i1" and len(x[1]) == len(y[1]) == 9
    _same(_round_trip(t), t)
    for schema in (WRITE_COLUMNS, COPY_COLUMNS):
        flat = Table.build(schema, **{name: np.zeros(1000) for name, _ in schema})
        stored = sum(len(c) if isinstance(c, memoryview) else len(c[1]) for c in flat.stored())
        assert sum(a.nbytes for a in flat.columns) <= 8 * stored


def test_plan_tables_round_trip() -> None:
    rng = np.random.default_rng(1)
    for schema in (WRITE_COLUMNS, COPY_COLUMNS):
        cols = {name: rng.integers(0, 1 << (8 * np.dtype(dt).itemsize - 2), 500)
                for name, dt in schema}
        cols[schema[2][0]] = np.zeros(500)
        t = Table.build(schema, **cols)
        _same(_round_trip(t), t)


@pytest.mark.parametrize("where", [0, 1])
def test_a_column_of_one_value_without_its_rows_is_refused(where: int) -> None:
    # ["=", value]: a form that would repeat a value over rows it does not store (a few
    # bytes decoding to any size) is no form of a plan, in the first column or any other
    cols: list[object] = [b"\0" * 16, b"\0" * 16]
    cols[where] = ["=", 5]
    with pytest.raises(PlanFormatError, match=f"t.{'xy'[where]}: narrow column '=' of") as e:
        Table.from_msgpack((("x", "<i8"), ("y", "<i8")), cols, "t")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("column, why", [
    (["=", 1], "narrow column"),  # no form of one value
    (["i4", b"\0" * 8], "narrow column"),  # not narrower than int32
    (["i8", b"\0" * 16], "narrow column"),  # not a narrow code
    (["u1", b"\0" * 2], "narrow column"),
    (["i2", b"\0" * 3], "narrow column"),  # half a value
    (["i2", "ab"], "narrow column"),
    ([1, b"\0" * 2], "a column is"),
    (["i2", b"\0\0", b""], "a column is"),
    (3, "a column is"),
])
def test_a_malformed_stored_column_is_refused(column: object, why: str) -> None:
    schema = (("x", "<i8"), ("y", "<i4"))
    with pytest.raises(PlanFormatError, match=f"t.y: {why}") as e:
        Table.from_msgpack(schema, [b"\0" * 16, column], "t")
    assert "\n" not in str(e.value)


def test_a_narrow_column_of_another_length_is_refused() -> None:
    with pytest.raises(PlanFormatError, match="y"):
        Table.from_msgpack((("x", "<i8"), ("y", "<i8")), [b"\0" * 16, ["i1", b"\0" * 3]], "t")
