"""What `cuda_ipc` exchanges about memory: a region's CUDA IPC handle (`IpcHandle`, on the
wire as msgpack fields, never pickle), torch's import of them, the raw handle inside
torch's, and `PeerRegion`, a peer's region mapped by `cuda_ipc` itself
(`cudaIpcOpenMemHandle` in the writer's own device context, raw addresses, as NCCL maps its
peers)."""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class IpcHandle:
    """One region as a peer opens it: torch's shareable CUDA handle of the region's storage
    (`UntypedStorage._share_cuda_()`: the first eight fields) and the region's place in that
    storage. On the wire: these fields in this order, as a msgpack list."""

    device: int
    handle: bytes
    """torch's shareable handle (`raw_handle` finds the CUDA one inside)."""
    size: int
    offset: int
    """The storage's byte offset in its cudaMalloc allocation."""
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes
    event_sync: bool
    storage_offset: int
    """The region's first element in the storage (bytes: regions are uint8)."""
    numel: int

    def to_wire(self) -> list[Any]:
        return list(astuple(self))

    @staticmethod
    def from_wire(f: Any, where: str = "region") -> IpcHandle:
        """The handle of a peer's record; a ValueError naming `where` when malformed."""
        kinds = [(x.name, bytes if x.type in ("bytes", bytes) else
                  bool if x.type in ("bool", bool) else int) for x in fields(IpcHandle)]
        if not isinstance(f, (list, tuple)) or len(f) != len(kinds) or not all(
                isinstance(v, k) and (k is bool or not isinstance(v, bool))
                for v, (_, k) in zip(f, kinds)):
            raise ValueError(f"{where}: a CUDA IPC handle is {len(kinds)} fields "
                             f"({', '.join(n for n, _ in kinds)}); got {str(f)[:80]}")
        return IpcHandle(*f)


def export_region(t: torch.Tensor) -> IpcHandle:
    storage = t.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    return IpcHandle(int(device), bytes(handle), int(size), int(offset), bytes(ref_handle),
                     int(ref_offset), bytes(event_handle or b""), bool(event_sync),
                     int(t.storage_offset()), int(t.numel()))


def import_region(h: IpcHandle) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared_cuda(
        h.device, h.handle, h.size, h.offset, h.ref_handle, h.ref_offset, h.event_handle,
        h.event_sync)
    t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{h.device}")
    return t.set_(storage, h.storage_offset, (h.numel,), (1,))


def raw_handle(handle: bytes) -> bytes | None:
    """The 64-byte `cudaIpcMemHandle_t` in torch's shareable handle (a version byte, the
    type `c` of a cudaMalloc block, the handle; or the bare handle of older torch), or None
    (an expandable segment's handle: only torch opens those)."""
    if len(handle) == 64:
        return handle
    return handle[2:] if len(handle) == 66 and handle[1:2] == b"c" else None


class PeerRegion:
    """A region of a peer on another GPU, mapped into this rank's device context by
    `cudaIpcOpenMemHandle` (not by torch): its address, size and owner device."""

    __slots__ = ("ptr", "nbytes", "device")

    def __init__(self, ptr: int, nbytes: int, device: int) -> None:
        self.ptr, self.nbytes, self.device = ptr, nbytes, device

    def data_ptr(self) -> int:
        return self.ptr


def segment(t: torch.Tensor, offset: int) -> int:
    """Base address of the cudaMalloc allocation holding `t`'s storage (`offset`: the
    storage's offset in it, as `_share_cuda_()` gives it)."""
    return t.untyped_storage().data_ptr() - offset
