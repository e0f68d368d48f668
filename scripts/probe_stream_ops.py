"""Probe: GPU-driven signals between two processes (CUDA stream memory operations).

    python scripts/probe_stream_ops.py [--devices 0,1] [--rounds 2000]

The design with the signals between ranks on the GPUs: a stream
waits until a flag reaches a value (`cuStreamWaitValue64`) and sets one after its copies
(`cuStreamWriteValue64`), so no host takes part in a step. This measures what that costs
with the flags in a shared-memory page both processes register with the driver: (1) the
round trip of a flag ping-pong driven only by the two GPUs' streams, (2) how long a stream
waiting on a flag takes to notice the other process's host setting it. With both
processes on one GPU (`--devices 0,0`) the GPU time-slices their contexts, and a stream
parked on a wait holds its slice. Nothing here is used by the executor.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import struct
import subprocess
import sys
import time

import torch

PING, PONG, HOST, STAMP = 0, 8, 16, 40  # flag offsets in the page; STAMP: a host time
WAIT_GEQ, WRITE_DEFAULT, DEVICEMAP = 0, 0, 2


class Driver:
    """The few driver calls the probe needs (the `_v2` entry points of CUDA 12)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u64, u32, i = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint, ctypes.c_int
        self.wait = lib.cuStreamWaitValue64_v2
        self.write = lib.cuStreamWriteValue64_v2
        for f in (self.wait, self.write):
            f.argtypes, f.restype = [vp, u64, u64, u32], i
        self.register = lib.cuMemHostRegister_v2
        self.register.argtypes, self.register.restype = [vp, ctypes.c_size_t, u32], i
        self.device_pointer = lib.cuMemHostGetDevicePointer_v2
        self.device_pointer.argtypes, self.device_pointer.restype = [
            ctypes.POINTER(u64), vp, u32], i

    def map(self, page: mmap.mmap) -> int:
        host = ctypes.addressof(ctypes.c_char.from_buffer(page))
        assert not self.register(host, mmap.PAGESIZE, DEVICEMAP), "cuMemHostRegister failed"
        dev = ctypes.c_uint64(0)
        assert not self.device_pointer(ctypes.byref(dev), host, 0)
        return dev.value


def child(path: str, role: int, device: int, rounds: int) -> None:
    torch.cuda.set_device(device)
    torch.zeros(1, device="cuda")  # the primary context, current in this thread
    drv = Driver()
    fd = os.open(path, os.O_RDWR)
    page = mmap.mmap(fd, mmap.PAGESIZE)
    os.close(fd)
    dev = drv.map(page)
    stream = torch.cuda.Stream()
    raw = stream.cuda_stream
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(1, rounds + 1):  # (1) ping-pong, GPUs only
        if role == 0:
            assert not drv.write(raw, dev + PING, i, WRITE_DEFAULT)
            assert not drv.wait(raw, dev + PONG, i, WAIT_GEQ)
        else:
            assert not drv.wait(raw, dev + PING, i, WAIT_GEQ)
            assert not drv.write(raw, dev + PONG, i, WRITE_DEFAULT)
    stream.synchronize()
    rt = (time.perf_counter() - t0) / rounds
    if role == 1:  # (2) a stream waiting on the other process's host
        assert not drv.wait(raw, dev + HOST, 1, WAIT_GEQ)
        ev = torch.cuda.Event()
        ev.record(stream)
        while not ev.query():
            pass
        late = time.perf_counter() - struct.unpack_from("<d", page, STAMP)[0]
        print(f"device {device}: a host flag noticed {late * 1e6:.1f} us after it was set",
              flush=True)
    else:
        time.sleep(0.2)
        struct.pack_into("<d", page, STAMP, time.perf_counter())
        struct.pack_into("<Q", page, HOST, 1)
        print(f"devices of the two processes {os.environ['PROBE_DEVICES']}: ping-pong round "
              f"trip {rt * 1e6:.2f} us ({rounds} rounds, GPUs only)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="0,1")
    ap.add_argument("--rounds", type=int, default=2000)
    a = ap.parse_args()
    devs = [int(d) for d in a.devices.split(",")]
    path = f"/dev/shm/rplan-probe-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(bytes(mmap.PAGESIZE))
    env = dict(os.environ, PROBE_DEVICES=a.devices)
    try:
        procs = [subprocess.Popen([sys.executable, __file__, "--child", path, str(r),
                                   str(devs[r]), str(a.rounds)], env=env) for r in (0, 1)]
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        os.unlink(path)
    if any(codes):
        raise SystemExit(f"a probe process failed: exit codes {codes}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
