"""Columnar tables of a plan: named numpy arrays of equal length, read-only; raw
little-endian bytes in msgpack."""

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

    @staticmethod
    def from_msgpack(schema: tuple[tuple[str, str], ...], raw: Any, what: str) -> Table:
        if not isinstance(raw, list) or len(raw) != len(schema):
            raise PlanFormatError(f"{what}: expected {len(schema)} columns")
        cols = {}
        for (name, dt), b in zip(schema, raw):
            if not isinstance(b, bytes) or len(b) % np.dtype(dt).itemsize:
                raise PlanFormatError(f"{what}.{name}: column bytes are malformed")
            cols[name] = np.frombuffer(b, dtype=dt)
        return Table.build(schema, **cols)


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
