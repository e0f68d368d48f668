"""Rendezvous stores: where ranks publish their regions and descriptors once, at load.

What a store must do: `set(key, bytes)`, and `get(key)` that returns the value, or None at
once when no rank has set the key. Stores whose `get` blocks until the key appears (torch's
`TCPStore`, `FileStore`, `HashStore`, `PrefixStore`, or any object with a torch-style
`check(keys) -> bool`) are accepted as they are: `get` is only called after `check` says the
key is there. A torch store is cloned (`Store.clone()`, its own connection): the caller may
block its own connection (`store.wait`) while the lease's heartbeat must go on. Everything
read from a store is checked (`control.py`) before it is used.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .transports.base import Store


class TorchStore:
    """A `torch.distributed.Store` (e.g. TCPStore) behind the non-blocking `Store` Protocol."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store.check([key]) else None


def open_store(rendezvous: object, rank: int, timeout_s: float) -> Store:
    """`"host:port"` (rank 0 hosts a TCPStore there), a torch Store, or a `Store` as is."""
    if isinstance(rendezvous, str):
        import torch.distributed as dist

        host, _, port = rendezvous.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"rendezvous {rendezvous!r} is not 'host:port'")
        store = dist.TCPStore(host, int(port), is_master=rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        return TorchStore(store)
    if type(rendezvous).__module__.startswith("torch"):
        try:  # a connection of our own: the caller may block theirs (store.wait), and the
            rendezvous = rendezvous.clone()  # lease's heartbeat must not wait behind it
        except Exception:  # noqa: BLE001 - a store that cannot clone: share it
            pass
        return TorchStore(rendezvous)
    if hasattr(rendezvous, "check"):
        return TorchStore(rendezvous)  # its get blocks: ask check() first
    if not (hasattr(rendezvous, "set") and hasattr(rendezvous, "get")):
        raise ValueError(f"rendezvous {rendezvous!r}: expected 'host:port', a torch Store, "
                         "or a store with set(key, bytes) and either a get(key) that returns "
                         "None at once for a missing key or check([key]) -> bool")
    return rendezvous  # type: ignore[return-value]
