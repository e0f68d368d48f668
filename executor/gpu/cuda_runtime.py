"""The CUDA runtime through ctypes: the calls `cuda_ipc` makes on raw handles.

The libcudart that torch loaded (never a second copy of the runtime): `cudaMemcpyAsync`,
events and graph launches, each far cheaper than torch's Python stream objects a batch;
torch's current stream as a raw `cudaStream_t`; host memory pinned and mapped for the GPU,
and the driver's stream writes (`StreamWrites`), with which the GPU publishes a
notification in shared memory once the copies before it have landed.

The calls keep the GIL (`ctypes.PyDLL`, not `CDLL`): they queue work and return within
microseconds, and a call that let the GIL go handed it to any waiting thread of the process
(the step publisher, the lease heartbeat), whose return took an OS wake-up on the step's
path.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator

import torch

from ..cleanup import best_effort


class IpcMemHandle(ctypes.Structure):
    """`cudaIpcMemHandle_t`: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # c_char would stop at the first NUL


class Runtime:
    """`cudaMemcpyAsync` and `cudaGetLastError` of the libcudart torch loaded."""

    D2D = 3  # cudaMemcpyDeviceToDevice: what torch's peer copy_ calls once P2P is enabled
    LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
    HOST_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped

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
        self.host_register = lib.cudaHostRegister
        self.host_register.argtypes, self.host_register.restype = [vp, sz, ctypes.c_uint], i
        self.host_unregister = lib.cudaHostUnregister
        self.host_unregister.argtypes, self.host_unregister.restype = [vp], i
        self.host_device_ptr = lib.cudaHostGetDevicePointer
        self.host_device_ptr.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_uint]
        self.host_device_ptr.restype = i
        self._get_device, self.set_device = lib.cudaGetDevice, lib.cudaSetDevice
        self._get_device.argtypes, self._get_device.restype = [ctypes.POINTER(i)], i
        self.set_device.argtypes, self.set_device.restype = [i], i

    def device(self) -> int:
        """The calling thread's current device (-1 if the runtime cannot say)."""
        d = ctypes.c_int(-1)
        return d.value if not self._get_device(ctypes.byref(d)) else -1

    @contextlib.contextmanager
    def on(self, index: int) -> Iterator[None]:
        """Device `index` current in this thread for the block (raw calls on stream 0, the
        legacy default stream, act on the CURRENT device's), the caller's put back after."""
        prev = self.device()
        if prev != index:
            self.set_device(index)
        try:
            yield
        finally:
            if prev != index and prev >= 0:
                self.set_device(prev)

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

    def map_host(self, address: int, nbytes: int) -> int:
        """Pin `nbytes` of host memory at `address` (whole pages, e.g. a shared-memory file's
        mapping) and map it for the GPU; its device address. `unmap_host` undoes it."""
        code = self.host_register(address, nbytes, self.HOST_MAPPED)
        if code:
            self.last_error()
            raise RuntimeError(f"cudaHostRegister failed (CUDA error {code})")
        ptr = ctypes.c_void_p()
        code = self.host_device_ptr(ctypes.byref(ptr), address, 0)
        if code or not ptr.value:
            self.last_error()
            self.host_unregister(address)
            raise RuntimeError(f"cudaHostGetDevicePointer failed (CUDA error {code})")
        return int(ptr.value)

    def unmap_host(self, address: int) -> None:
        if self.host_unregister(address):
            self.last_error()  # clear it: torch would report it later

    @staticmethod
    def load() -> Runtime | None:
        paths = best_effort("reading /proc/self/maps", _loaded_cudart, default=[])
        for path in dict.fromkeys(paths):  # never a second copy of the runtime
            try:
                return Runtime(ctypes.PyDLL(path))
            except (OSError, AttributeError):
                continue
        return None


class StreamWrites:
    """`cuStreamWriteValue64` of the driver torch's runtime loaded: a stream operation that
    writes 8 bytes once the work queued before it on the stream is done, after a memory
    fence (the GPU publishes a value without the host). Little host time; capturable."""

    def __init__(self, fn: Callable[..., int]) -> None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        self.fn = fn

    def write64(self, stream: int, device_address: int, value: int) -> int:
        """Queue the write on `stream`; the CUDA driver's error code (0: queued)."""
        return self.fn(stream, device_address, value, 0)  # 0: with the fence before it

    @staticmethod
    def load() -> StreamWrites | None:
        try:
            lib = ctypes.PyDLL("libcuda.so.1")  # the one the runtime loaded (dlopen: same)
        except OSError:
            return None
        for name in ("cuStreamWriteValue64_v2", "cuStreamWriteValue64"):
            fn = getattr(lib, name, None)
            if fn is not None:
                return StreamWrites(fn)
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


def _loaded_cudart() -> list[str]:
    """Paths of the CUDA runtime libraries this process has mapped."""
    with open("/proc/self/maps") as f:
        return [ln.split()[-1] for ln in f if "libcudart.so" in ln]


class MemcpyAttributes(ctypes.Structure):
    """`CUmemcpyAttributes`: the source access order, two location hints (type, id) and
    flags. Only the order is set (in stream order); the hints stay unset, as UCX's CUDA IPC
    transport leaves them for its scatter-gather puts."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_type", ctypes.c_int),
                ("src_id", ctypes.c_int), ("dst_type", ctypes.c_int), ("dst_id", ctypes.c_int),
                ("flags", ctypes.c_uint)]


class BatchCopies:
    """`cuMemcpyBatchAsync` of the driver torch's runtime loaded: many copies queued in one
    call, which the driver hands to the copy engines as one batch (no SMs; far less per
    copy than one `cudaMemcpyAsync` each). CUDA 13's `_v2` entry point, else 12.8's, which
    takes one more argument (the index of a copy that failed)."""

    STREAM_ORDER = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

    def __init__(self, fn: Callable[..., int], with_fail_index: bool) -> None:
        p = ctypes.c_void_p
        fn.argtypes = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t] + \
            ([p] if with_fail_index else []) + [p]
        fn.restype = ctypes.c_int
        self.fn, self.with_fail_index = fn, with_fail_index
        self.attrs = MemcpyAttributes(src_access_order=self.STREAM_ORDER)
        self.attrs_idx = ctypes.c_size_t(0)
        self.fail_index = ctypes.c_size_t(0)

    def prepare(self, dst: list[int], src: list[int], nbytes: list[int], first: int = 4,
                most: int = 128) -> list[tuple]:
        """A batch's copies as the arrays the calls read (keep them alive as long as the
        batch may be posted): `first` copies in the first call, each next call twice the
        last, at most `most`. The driver queues a call's copies only when it returns, after
        some host time per copy, so one call of a thousand copies would leave the link
        idle a thousand times that; in growing calls the copies start after the first
        few are queued, and the host stays ahead of the link."""
        calls, i, k = [], 0, max(1, first)
        while i < len(nbytes):
            j = min(len(nbytes), i + k)
            n = j - i
            calls.append(((ctypes.c_uint64 * n)(*dst[i:j]), (ctypes.c_uint64 * n)(*src[i:j]),
                          (ctypes.c_size_t * n)(*nbytes[i:j]), n))
            i, k = j, min(2 * k, max(most, first))
        return calls

    def post(self, prepared: list[tuple], stream: int) -> int:
        """Queue the copies of `prepared` on `stream`; the driver's error code (0: queued)."""
        extra = (ctypes.byref(self.fail_index),) if self.with_fail_index else ()
        attrs, idx = ctypes.byref(self.attrs), ctypes.byref(self.attrs_idx)
        for d, s, n, count in prepared:
            code = self.fn(d, s, n, count, attrs, idx, 1, *extra, stream)
            if code:
                return code
        return 0

    @staticmethod
    def load() -> BatchCopies | None:
        try:
            lib = ctypes.PyDLL("libcuda.so.1")
        except OSError:
            return None
        fn = getattr(lib, "cuMemcpyBatchAsync_v2", None)
        if fn is not None:
            return BatchCopies(fn, with_fail_index=False)
        fn = getattr(lib, "cuMemcpyBatchAsync", None)
        return BatchCopies(fn, with_fail_index=True) if fn is not None else None
