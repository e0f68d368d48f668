"""Transports: one module each, behind the `Transport` Protocol of `base.py`, named in one
table (`TRANSPORTS`: each transport's options dataclass and its constructor)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TransportOptionError
from .base import Store, Transport
from .options import CudaIpcOptions, LocalOptions, NixlOptions, UcclOptions, parse

Factory = Callable[[int, str, Store, torch.device], Transport]


def _local(rank: int, namespace: str, store: Store, device: torch.device,
           opts: LocalOptions) -> Transport:
    from .local import Fabric, LocalTransport
    return LocalTransport(rank, namespace, store if isinstance(store, Fabric) else None, opts)


def _nixl(rank: int, namespace: str, store: Store, device: torch.device,
          opts: NixlOptions) -> Transport:
    from .nixl import NixlTransport
    return NixlTransport(rank, namespace, opts)


def _cuda_ipc(rank: int, namespace: str, store: Store, device: torch.device,
              opts: CudaIpcOptions) -> Transport:
    from .cuda_ipc import CudaIpcTransport
    return CudaIpcTransport(rank, namespace, store, device, opts)


def _uccl(rank: int, namespace: str, store: Store, device: torch.device,
          opts: UcclOptions) -> Transport:
    from .uccl import UcclTransport
    return UcclTransport(rank, namespace, store, device, opts.num_cpus)


@dataclass(frozen=True, slots=True)
class Kind:
    """One transport: its typed options and how to build it (its module is imported only
    when one is built, so a bad name or option is refused before any library loads)."""

    options: type
    build: Callable[[int, str, Store, torch.device, Any], Transport]


TRANSPORTS: dict[str, Kind] = {
    "nixl": Kind(NixlOptions, _nixl),
    "cuda_ipc": Kind(CudaIpcOptions, _cuda_ipc),
    "uccl": Kind(UcclOptions, _uccl),
    "local": Kind(LocalOptions, _local),
}
"""Every transport `executor.load(transport=...)` accepts."""


def make_transport(kind: str, options: dict[str, Any] | None = None) -> Factory:
    """A constructor of transport `kind` with its options checked (before anything loads)."""
    if kind not in TRANSPORTS:
        raise TransportOptionError(f"transport {kind!r} is unknown; use one of "
                                   f"{', '.join(repr(k) for k in TRANSPORTS)}")
    entry = TRANSPORTS[kind]
    opts = parse(kind, entry.options, options)

    def make(rank: int, namespace: str, store: Store, device: torch.device) -> Transport:
        return entry.build(rank, namespace, store, device, opts)
    return make
