"""What `cuda_ipc` exchanges about memory: a region's CUDA IPC handle (`IpcHandle`, on the
wire as a msgpack map of named fields, every one checked before use, never pickle), torch's
import of them, the raw handle inside torch's, and `PeerRegion`, a peer's region mapped by
`cuda_ipc` itself (`cudaIpcOpenMemHandle` in the writer's own device context, raw addresses,
as NCCL maps its peers)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

MAX_HANDLE_BYTES = 1 << 20
"""The largest opaque handle accepted from a peer (torch's handle of an expandable segment
grows with the segment's pages; a cudaMalloc block's is 66 bytes)."""
MAX_REF_BYTES = 4096
"""The largest reference-counter name accepted from a peer (torch's is a shared-memory
file name)."""
EVENT_HANDLE_BYTES = 64
"""`cudaIpcEventHandle_t`: torch's event handle, or empty where there is none."""
INT64_MAX = (1 << 63) - 1
MAX_DEVICE = 1023


@dataclass(frozen=True)
class IpcHandle:
    """One region as a peer opens it: torch's shareable CUDA handle of the region's storage
    (`UntypedStorage._share_cuda_()`: the first eight fields) and the region's place in that
    storage. On the wire: a msgpack map of these fields by name (`to_msgpack`); a peer's map
    is checked field by field before anything opens it (`from_msgpack`)."""

    device: int
    """The CUDA device the region lives on (its index on this host)."""
    handle: bytes
    """torch's shareable handle (`raw_handle` finds the CUDA one inside)."""
    size: int
    """The storage's size in bytes."""
    offset: int
    """The storage's byte offset in its cudaMalloc allocation."""
    ref_handle: bytes
    """torch's reference counter of the exported block (a shared-memory file name)."""
    ref_offset: int
    """This storage's slot in that counter."""
    event_handle: bytes
    """torch's CUDA IPC event handle (64 bytes, or empty)."""
    event_sync: bool
    """Whether the importer waits on that event before it uses the memory."""
    storage_offset: int
    """The region's first element in the storage (bytes: regions are uint8)."""
    numel: int
    """The region's length in bytes."""

    def to_msgpack(self) -> dict[str, Any]:
        """The handle as a msgpack map (field name -> value)."""
        return asdict(self)

    @staticmethod
    def from_msgpack(m: Any, where: str = "region") -> IpcHandle:
        """The handle of a peer's map, every field checked (type, size, range): a ValueError
        of one line naming `where`, the field and its value otherwise."""
        names = [f.name for f in fields(IpcHandle)]
        if not isinstance(m, dict) or set(m) != set(names):
            got = sorted(map(str, m)) if isinstance(m, dict) else type(m).__name__
            raise ValueError(f"{where}: a CUDA IPC handle is a map of the fields "
                             f"{', '.join(names)}; got {str(got)[:120]} (the peer must run "
                             "the same rdma-plan version)")
        for name in names:
            _check(where, name, m[name])
        if m["event_sync"] and len(m["event_handle"]) != EVENT_HANDLE_BYTES:
            _refuse(where, "event_handle", m["event_handle"],
                    f"with event_sync it must be {EVENT_HANDLE_BYTES} bytes")
        if m["storage_offset"] + m["numel"] > m["size"]:
            _refuse(where, "numel", m["numel"], f"the region (from storage_offset "
                    f"{m['storage_offset']}) must end within the storage's {m['size']} bytes")
        return IpcHandle(**{n: m[n] for n in names})


def peer_handles(peer: int, desc: Any) -> list[IpcHandle]:
    """The region handles of a peer's `cuda_ipc` descriptor, every field checked
    (`IpcHandle.from_msgpack`) before any is used; a ValueError of one line otherwise."""
    regions = desc.get("regions") if isinstance(desc, dict) else None
    if not isinstance(regions, list):
        raise ValueError(f"rank {peer}'s cuda_ipc descriptor has no list of 'regions' "
                         f"(got {type(regions).__name__}); the peer must run the same "
                         "rdma-plan version")
    return [IpcHandle.from_msgpack(f, f"rank {peer}'s region {i}")
            for i, f in enumerate(regions)]


def check_desc(peer: int, desc: Any, sizes: Iterable[tuple[int, int]],
               device_bytes: Callable[[int], int | None] | None = None) -> None:
    """A peer's `cuda_ipc` descriptor against the plan's regions of that peer (`sizes`:
    (region, bytes), the plan's `peer_regions`), before any pointer of it is made: every
    field checked (`IpcHandle.from_msgpack`), each region the plan names present with
    exactly the plan's bytes (`numel`), and its storage inside an allocation the device can
    hold (`offset + size` within `device_bytes(device)`: the device's memory). A ValueError
    of one line naming the peer, the region, the field and the fix otherwise."""
    handles = peer_handles(peer, desc)
    for r, n in sizes:
        where = f"rank {peer}'s region {r}"
        if not 0 <= r < len(handles):
            raise ValueError(f"{where}: the peer exported {len(handles)} region handles, the "
                             f"plan writes region {r}; bind the tensors the plan was compiled "
                             "for on that rank")
        if handles[r].numel != n:
            _refuse(where, "numel", handles[r].numel, f"the plan's region is {n} bytes")
    for i, h in enumerate(handles):
        cap = None if device_bytes is None else device_bytes(h.device)
        if cap is not None and h.offset + h.size > cap:
            _refuse(f"rank {peer}'s region {i}", "offset", h.offset,
                    f"with size {h.size} it ends past the {cap} bytes of device {h.device}")


def device_memory(device: int) -> int | None:
    """The memory of CUDA device `device` in bytes (None where there is no such device)."""
    if not torch.cuda.is_available() or not 0 <= device < torch.cuda.device_count():
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def check_cuda_desc(peer: int, desc: Any, sizes: Iterable[tuple[int, int]]) -> None:
    """`check_desc` against the memory of this host's devices (`CudaIpcTransport`)."""
    check_desc(peer, desc, sizes, device_memory)


def _check(where: str, name: str, v: Any) -> None:
    """One field of a peer's handle: its type, then its size or range."""
    if name in ("handle", "ref_handle", "event_handle"):
        if not isinstance(v, bytes):
            _refuse(where, name, v, "it must be bytes")
        if name == "handle" and not 0 < len(v) <= MAX_HANDLE_BYTES:
            _refuse(where, name, v, f"it must be 1 to {MAX_HANDLE_BYTES} bytes")
        if name == "ref_handle" and not 0 < len(v) <= MAX_REF_BYTES:
            _refuse(where, name, v, f"it must be 1 to {MAX_REF_BYTES} bytes")
        if name == "event_handle" and len(v) not in (0, EVENT_HANDLE_BYTES):
            _refuse(where, name, v, f"it must be empty or {EVENT_HANDLE_BYTES} bytes")
    elif name == "event_sync":
        if not isinstance(v, bool):
            _refuse(where, name, v, "it must be true or false")
    elif not isinstance(v, int) or isinstance(v, bool):
        _refuse(where, name, v, "it must be an integer")
    elif not 0 <= v <= (MAX_DEVICE if name == "device" else INT64_MAX):
        _refuse(where, name, v, f"it must be 0 to {MAX_DEVICE if name == 'device' else INT64_MAX}")


def _refuse(where: str, name: str, v: Any, rule: str) -> None:
    shown = f"{len(v)} bytes" if isinstance(v, bytes) else repr(v)[:60]
    raise ValueError(f"{where}: CUDA IPC handle field {name!r} is {shown}: {rule} (the peer "
                     "must export it with the same rdma-plan version)")


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
