"""Transports: one module each, behind the `Transport` Protocol of `base.py`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .base import Store, Transport
from .options import parse

Factory = Callable[[int, str, Store, torch.device], Transport]


def make_transport(kind: str, options: dict[str, Any] | None = None) -> Factory:
    """A constructor of transport `kind` with its options checked (before anything loads)."""
    opts = parse(kind, options)

    def make(rank: int, namespace: str, store: Store, device: torch.device) -> Transport:
        if kind == "local":
            from .local import Fabric, LocalTransport
            return LocalTransport(rank, namespace, store if isinstance(store, Fabric) else None,
                                  opts)
        if kind == "nixl":
            from .nixl import NixlTransport
            return NixlTransport(rank, namespace, opts)
        if kind == "cuda_ipc":
            from .cuda_ipc import CudaIpcTransport
            return CudaIpcTransport(rank, namespace, store, device, opts)
        from .uccl import UcclTransport
        return UcclTransport(rank, namespace, store, device, opts.num_cpus)
    return make
