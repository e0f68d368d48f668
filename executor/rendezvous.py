"""Rendezvous stores: where ranks publish their regions and descriptors once, at load.

What a store must do: `set(key, bytes)`, and `get(key)` that returns the value, or None at
once when no rank has set the key. Stores whose `get` blocks until the key appears (torch's
`TCPStore`, `FileStore`, `HashStore`, `PrefixStore`, or any object with a torch-style
`check(keys) -> bool`) are accepted as they are: `get` is only called after `check` says the
key is there. A torch store is cloned (`Store.clone()`, its own connection): the caller may
block its own connection (`store.wait`) while the lease's heartbeat must go on. Everything
read from a store is checked (`control.py`) before it is used.

`connect_store("host:port")` is a client of a store the launcher already hosts (what a
trainer under torchrun passes: its rank 0 must not try to host a second one there).
A `"host:port"` store is made within `timeout_s` or refused in one line
(`RendezvousError`): torch's `TCPStore` client waits forever, whatever its timeout, on a
port where another service (a gloo or NCCL listener) accepts and never answers, and its
host raises a socket error when the port is taken.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from .cleanup import best_effort
from .errors import RendezvousError
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
        return TorchStore(tcp_store(dist, host, int(port), rank, timeout_s))
    if type(rendezvous).__module__.startswith("torch"):
        # a connection of our own: the caller may block theirs (store.wait), and the
        # lease's heartbeat must not wait behind it; a store that cannot clone is shared
        rendezvous = best_effort("cloning the store", rendezvous.clone, default=rendezvous)
        return TorchStore(rendezvous)
    if hasattr(rendezvous, "check"):
        return TorchStore(rendezvous)  # its get blocks: ask check() first
    if not (hasattr(rendezvous, "set") and hasattr(rendezvous, "get")):
        raise ValueError(f"rendezvous {rendezvous!r}: expected 'host:port', a torch Store, "
                         "or a store with set(key, bytes) and either a get(key) that returns "
                         "None at once for a missing key or check([key]) -> bool")
    return rendezvous  # type: ignore[return-value]


def tcp_store(dist: Any, host: str, port: int, rank: int, timeout_s: float) -> Any:
    """A TCPStore at host:port (hosted by rank 0), made in a thread that is given up on after
    `timeout_s` (torch's client never returns from a listener that does not answer)."""
    made: list[Any] = []

    def make() -> None:
        try:
            made.append(dist.TCPStore(host, port, is_master=rank == 0, wait_for_workers=False,
                                      timeout=timedelta(seconds=timeout_s)))
        except Exception as e:  # noqa: BLE001 - reported below, in one line
            made.append(e)

    thread = threading.Thread(target=make, daemon=True, name=f"rplan-store-{rank}")
    thread.start()
    thread.join(timeout_s + 5.0)
    got = made[0] if made else None
    where = f"rendezvous {host}:{port} ({f'rank {rank}' if rank >= 0 else 'client'}"
    if got is None:
        raise RendezvousError(
            f"{where}): nothing there answered as a TCPStore within {timeout_s:g} s; another "
            "service may hold that port: give every rank a free port for the rendezvous")
    if isinstance(got, Exception):
        first = str(got).splitlines()[0]
        if rank != 0:
            raise RendezvousError(f"{where}) could not reach the store: {first}; start the "
                                  "store first (rank 0 or the launcher hosts it)") from got
        raise RendezvousError(
            f"{where}) could not host the store: {first}; if the launcher (or another "
            "process) already hosts a store there, pass a client of it instead: "
            f"rendezvous=executor.connect_store('{host}:{port}'); otherwise give every rank a "
            "host:port nobody listens on") from got
    return got


def store_at(address: str, hosted: bool, timeout_s: float) -> object:
    """What `LoadOptions.rendezvous` gets for an engine's `host:port`: the address as is (plan
    rank 0 hosts a store there), or with `hosted` (the integrations' `rendezvous_hosted`) a
    client of the store already running there (`connect_store`), on every rank."""
    return connect_store(address, timeout_s) if hosted else address


def connect_store(address: str, timeout_s: float = 60.0) -> Any:
    """A client of the TCPStore someone else hosts at `"host:port"` (the launcher, a
    trainer's `torch.distributed` store): pass it as `rendezvous=` on every rank, so no
    rank tries to host a store where one already runs. Refused in one line within
    `timeout_s` (`RendezvousError`) when nothing there answers."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous {address!r} is not 'host:port'")
    return tcp_store(dist, host, int(port), -1, timeout_s)
