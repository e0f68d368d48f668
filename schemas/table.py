"""Columnar tables of a plan: named numpy arrays of equal length, read-only; in msgpack
each column is stored in one of two forms (`stored_column`, read by `from_msgpack`):

- a bin: the column's raw little-endian bytes in its schema dtype;
- `[code, bin]`, `code` one of `NARROW` (`"i1"`, `"i2"`, `"i4"`): the column's integers as
  little-endian signed integers of that narrower width (every value fits: exact).

A decoded table is the same whatever the form: each column in its schema dtype. Every row
of every column is stored, at least one byte a value, so a decoded table is at most 8
times its stored columns' bytes (an `i1` column of an int64): no form repeats a value
over rows it does not store (a hostile file's tables stay within a few times its
inflated bytes, themselves bounded by `plan_codec`)."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import PlanFormatError


@dataclass(frozen=True, slots=True)
class Table:
    """A columnar table: named numpy arrays of equal length, read-only."""

    schema: tuple[tuple[str, str], ...]
    columns: tuple[np.ndarray, ...]

    @staticmethod
    def build(schema: tuple[tuple[str, str], ...], **cols: Any) -> Table:
        n = None
        arrays = []
        for name, dt in schema:
            if name not in cols:
                raise PlanFormatError(f"table column {name!r} is missing")
            a = np.ascontiguousarray(np.asarray(cols[name], dtype=dt))
            if a.ndim != 1 or (n is not None and len(a) != n):
                raise PlanFormatError(f"table column {name!r} has shape {a.shape}, expected "
                                      f"({n},)")
            n = len(a)
            a.flags.writeable = False
            arrays.append(a)
        return Table(schema, tuple(arrays))

    @staticmethod
    def empty(schema: tuple[tuple[str, str], ...]) -> Table:
        return Table.build(schema, **{name: [] for name, _ in schema})

    def __len__(self) -> int:
        return len(self.columns[0]) if self.columns else 0

    def __getitem__(self, name: str) -> np.ndarray:
        for (n, _), a in zip(self.schema, self.columns):
            if n == name:
                return a
        raise KeyError(name)

    def to_msgpack(self) -> list[bytes]:
        return [a.tobytes() for a in self.columns]

    def views(self) -> list[memoryview]:
        """The columns' bytes without copying them: msgpack packs each exactly as the bytes
        of `to_msgpack` (a bin), so encoders of large plans use these."""
        return [memoryview(a).cast("B") for a in self.columns]

    def stored(self) -> list[Any]:
        """The columns in their stored forms (`stored_column`), as msgpack packs them."""
        return [stored_column(a) for a in self.columns]

    @staticmethod
    def from_msgpack(schema: tuple[tuple[str, str], ...], raw: Any, what: str) -> Table:
        """The table of `raw`, its columns in any stored form (the module's docstring)."""
        if not isinstance(raw, list) or len(raw) != len(schema):
            raise PlanFormatError(f"{what}: expected {len(schema)} columns")
        cols = {name: _column(b, dt, f"{what}.{name}") for (name, dt), b in zip(schema, raw)}
        return Table.build(schema, **cols)


@dataclass(frozen=True, slots=True)
class RangedTable(Table):
    """A table whose columns' least and greatest values are known already (`ranges`: one
    `(lo, hi)` a column, None where not known): the plan writer takes a column's stored
    form from them instead of reading the whole column once more (a spilled table's
    columns are mapped from a file: `planner.passes.explain.spilled`)."""

    ranges: tuple[tuple[int, int] | None, ...] = ()


NARROW = {"i1": "<i1", "i2": "<i2", "i4": "<i4"}
"""The narrower widths a stored integer column may take (code -> dtype)."""


def stored_column(a: np.ndarray) -> Any:
    """Column `a` in its stored form: an integer column whose values fit a narrower width
    in it, else its raw bytes."""
    view = memoryview(np.ascontiguousarray(a)).cast("B")
    if stored_plainly(a):
        return view
    code = narrow_code(int(a.min()), int(a.max()), a.dtype.itemsize)
    if code is None:
        return view
    return [code, memoryview(a.astype(NARROW[code])).cast("B")]


def stored_plainly(a: np.ndarray) -> bool:
    """Whether column `a` is stored raw whatever its values (empty, one byte a value, or
    not a signed integer column)."""
    return len(a) == 0 or a.dtype.itemsize == 1 or a.dtype.kind != "i"


def narrow_code(lo: int, hi: int, itemsize: int) -> str | None:
    """The narrowest `NARROW` code whose range holds `[lo, hi]` and is narrower than
    `itemsize` bytes, or None (raw). One value over all rows is narrowed too (deflate
    shrinks its run): a form that repeats a value over rows it does not store would let a
    few bytes decode to any size (the module's docstring)."""
    for code, size, least, most in _RANGES:
        if size < itemsize and least <= lo and hi <= most:
            return code
    return None


_RANGES = tuple((code, np.dtype(dt).itemsize, int(np.iinfo(dt).min), int(np.iinfo(dt).max))
                for code, dt in NARROW.items())
"""Each `NARROW` code's width and range, in its order (`narrow_code` runs per column)."""


def narrow_dtype(code: Any, dt: str) -> np.dtype | None:
    """The dtype a column of `dt` stored narrow under `code` holds, or None where `code` is
    no narrow form of it (not a `NARROW` code, or not narrower than an integer `dt`)."""
    narrow = NARROW.get(code) if isinstance(code, str) else None
    if narrow is None or np.dtype(dt).kind != "i" or \
            np.dtype(narrow).itemsize >= np.dtype(dt).itemsize:
        return None
    return np.dtype(narrow)


def _column(b: Any, dt: str, what: str) -> np.ndarray:
    """One stored column (`stored_column`'s forms) as `dt`."""
    size = np.dtype(dt).itemsize
    if isinstance(b, bytes):
        if len(b) % size:
            raise PlanFormatError(f"{what}: column bytes are malformed")
        return np.frombuffer(b, dtype=dt)
    if not isinstance(b, list) or len(b) != 2 or not isinstance(b[0], str):
        raise PlanFormatError(f"{what}: a column is bytes or [code, bytes]")
    code, body = b
    narrow = narrow_dtype(code, dt)
    if narrow is None or not isinstance(body, bytes) or len(body) % narrow.itemsize:
        raise PlanFormatError(f"{what}: narrow column {code[:8]!r} of {dt} is malformed "
                              f"(codes {', '.join(NARROW)}, narrower than the column)")
    return np.frombuffer(body, dtype=narrow).astype(dt)


_DIGESTS: list[tuple[Table, bytes]] = []
"""The last few tables digested and their digests, by identity (a table's columns are
read-only and it is frozen: the same object always has the same bytes)."""


def table_digest(t: Table) -> bytes:
    """SHA-256 of a table's schema and column bytes (each column's length first, so no two
    tables share a digest but by a collision). The last few are kept by identity: a rank's
    copies are digested once for every check that keys on them."""
    for seen, d in _DIGESTS:
        if seen is t:
            return d
    h = hashlib.sha256(repr(t.schema).encode())
    for a in t.columns:
        h.update(struct.pack("<Q", a.nbytes))
        h.update(np.ascontiguousarray(a))
    d = h.digest()
    _DIGESTS[:] = [(t, d), *_DIGESTS[:3]]
    return d


def content_key(*parts: Any) -> bytes:
    """SHA-256 of `parts`, each a numpy array (its dtype, shape and bytes), bytes, or a
    plain value (its `repr`: ints, strings, floats, tuples of them), each tagged and
    length-prefixed: two keys are equal only where every part is (but by a collision).
    What a pure check of a rank's columns is keyed by, so that it runs once for equal
    inputs (`schemas.bounds`, `schemas.protocol.overlap`)."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, np.ndarray):
            b = f"a{p.dtype.str}{p.shape}".encode()
            h.update(struct.pack("<Q", len(b)) + b)
            h.update(struct.pack("<Q", p.nbytes))
            h.update(np.ascontiguousarray(p))
        else:
            b = (b"b" + p) if isinstance(p, bytes) else f"v{p!r}".encode()
            h.update(struct.pack("<Q", len(b)) + b)
    return h.digest()


def among(a: np.ndarray, values: tuple[int, ...] | list[int]) -> np.ndarray:
    """`np.isin(a, values)` for a few values (an op's kinds, dtype codes): one comparison a
    value, without `isin`'s sorting or tables (tens of microseconds a call, on columns read
    hundreds of times a plan)."""
    out = np.zeros(np.shape(a), dtype=bool)
    for v in values:
        out |= a == v
    return out
