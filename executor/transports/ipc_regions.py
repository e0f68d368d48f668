"""What `cuda_ipc` exchanges about memory: a region's CUDA IPC handle as msgpack fields
(never pickle), torch's import of them, the raw handle inside torch's, and `PeerRegion`, a
peer's region mapped by `cuda_ipc` itself (`cudaIpcOpenMemHandle` in the writer's own
device context, raw addresses, as NCCL maps its peers)."""

from __future__ import annotations

from typing import Any

import torch


def export_region(t: torch.Tensor) -> list[Any]:
    storage = t.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    return [int(device), bytes(handle), int(size), int(offset), bytes(ref_handle),
            int(ref_offset), bytes(event_handle or b""), bool(event_sync),
            int(t.storage_offset()), int(t.numel())]


def import_region(fields: list[Any]) -> torch.Tensor:
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync, \
        storage_offset, numel = fields
    storage = torch.UntypedStorage._new_shared_cuda(
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync)
    t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    return t.set_(storage, storage_offset, (numel,), (1,))


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
