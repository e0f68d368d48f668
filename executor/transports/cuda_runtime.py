"""The CUDA runtime through ctypes: the calls `cuda_ipc` makes on raw handles.

The libcudart that torch loaded (never a second copy of the runtime): `cudaMemcpyAsync`,
events and graph launches, ~1 us each where torch's Python stream objects cost
~100 us a batch; torch's current stream as a raw `cudaStream_t`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch


class IpcMemHandle(ctypes.Structure):
    """`cudaIpcMemHandle_t`: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # c_char would stop at the first NUL


class Runtime:
    """`cudaMemcpyAsync` and `cudaGetLastError` of the libcudart torch loaded."""

    D2D = 3  # cudaMemcpyDeviceToDevice: what torch's peer copy_ calls once P2P is enabled
    LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self.memcpy_async = lib.cudaMemcpyAsync
        self.memcpy_async.argtypes = [vp, vp, sz, i, vp]
        self.memcpy_async.restype = i
        self.last_error = lib.cudaGetLastError
        self.last_error.restype = i
        self.event_record = lib.cudaEventRecord
        self.event_record.argtypes, self.event_record.restype = [vp, vp], i
        self.wait_event = lib.cudaStreamWaitEvent
        self.wait_event.argtypes, self.wait_event.restype = [vp, vp, ctypes.c_uint], i
        self.event_query = lib.cudaEventQuery
        self.event_query.argtypes, self.event_query.restype = [vp], i
        self.graph_launch = lib.cudaGraphLaunch
        self.graph_launch.argtypes, self.graph_launch.restype = [vp, vp], i
        self.ipc_open = lib.cudaIpcOpenMemHandle
        self.ipc_open.argtypes = [ctypes.POINTER(vp), IpcMemHandle, ctypes.c_uint]
        self.ipc_open.restype = i
        self.ipc_close = lib.cudaIpcCloseMemHandle
        self.ipc_close.argtypes, self.ipc_close.restype = [vp], i

    def open_handle(self, handle: bytes) -> int:
        """Map a peer's allocation (a raw 64-byte IPC handle) into the current device's
        context, peer access enabled as needed; its base address. Opening a handle this
        context has open already gives the same address (the driver counts the opens)."""
        ptr = ctypes.c_void_p()
        code = self.ipc_open(ctypes.byref(ptr), IpcMemHandle.from_buffer_copy(handle),
                             self.LAZY_PEER)
        if code or not ptr.value:
            self.last_error()  # clear it: torch would report it later
            raise RuntimeError(f"cudaIpcOpenMemHandle failed (CUDA error {code})")
        return int(ptr.value)

    @staticmethod
    def load() -> Runtime | None:
        paths = []
        try:
            with open("/proc/self/maps") as f:
                paths = [ln.split()[-1] for ln in f if "libcudart.so" in ln]
        except OSError:
            pass
        for path in dict.fromkeys(paths):  # never a second copy of the runtime
            try:
                return Runtime(ctypes.CDLL(path))
            except (OSError, AttributeError):
                continue
        return None


def current_raw_stream() -> Callable[[int], int] | None:
    """torch's current stream of a device as a raw `cudaStream_t`, without torch's Python
    stream objects (None where this torch lacks it, or lacks raw graph handles)."""
    fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fn is None or not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        return None
    return fn


def load_cudart() -> Runtime | None:
    """The one loader of the CUDA runtime (used by this transport and the benchmarks)."""
    return Runtime.load()


NOT_READY = 600  # cudaErrorNotReady: what cudaEventQuery says of work still running
