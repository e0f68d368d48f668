"""How `cuda_ipc` reads torch's shareable CUDA IPC handles before opening a peer's memory
in its own device context (any machine: no GPU is touched)."""

from __future__ import annotations

import os

from executor.transports.cuda_runtime import IpcMemHandle
from executor.transports.ipc_regions import raw_handle


def test_the_handle_passed_by_value_keeps_every_byte_nuls_included():
    # a real handle has NUL bytes; a c_char array field stopped at the first one
    handle = bytes([0, 1, 2, 0, 5]) + os.urandom(58) + b"\0"
    assert bytes(IpcMemHandle.from_buffer_copy(handle)) == handle


def test_torch_handles_are_read_by_their_type_byte():
    h = os.urandom(64)
    assert raw_handle(h) == h  # a bare cudaIpcMemHandle_t (older torch)
    for version in (2, 3):  # torch <= 2.12 and 2.13: version, type 'c', the handle
        assert raw_handle(bytes([version]) + b"c" + h) == h
    assert raw_handle(bytes([2]) + b"e" + h) is None  # an expandable segment: torch's only
    assert raw_handle(h[:40]) is None


def test_an_ipc_handle_travels_as_its_fields_and_a_malformed_one_is_one_line():
    from executor.transports.ipc_regions import IpcHandle

    h = IpcHandle(1, bytes([3]) + b"c" + os.urandom(64), 1 << 20, 512, b"ref", 7, b"", False,
                  64, 4096)
    wire = h.to_wire()
    assert len(wire) == 10 and wire[3] == 512 and wire[8] == 64
    assert IpcHandle.from_wire(wire) == h
    for bad in ([1, 2], wire[:9], [*wire[:7], 1, *wire[8:]], [*wire[:2], "x", *wire[3:]], None):
        try:
            IpcHandle.from_wire(bad, "rank 3's region 0")
        except ValueError as e:
            assert str(e).startswith("rank 3's region 0: a CUDA IPC handle is 10 fields")
            assert "\n" not in str(e)
        else:
            raise AssertionError(f"accepted {bad!r}")
