"""An in-memory key/value store with the executor's `Store` face (set, get: None if absent)."""

from __future__ import annotations


class Dict:
    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.kv[key] = value

    def get(self, key: str) -> bytes | None:
        return self.kv.get(key)
