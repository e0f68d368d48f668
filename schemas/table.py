"""Columnar tables of a plan: named numpy arrays of equal length, read-only; raw
little-endian bytes in msgpack."""

from __future__ import annotations

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
