"""How `cuda_ipc` reads torch's shareable CUDA IPC handles, and a peer's handles off the
wire, before opening a peer's memory (any machine: no GPU is touched)."""

from __future__ import annotations

import os

import pytest

from executor.gpu.cuda_runtime import IpcMemHandle
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


def _handle():
    from executor.transports.ipc_regions import IpcHandle

    return IpcHandle(1, bytes([3]) + b"c" + os.urandom(64), 1 << 20, 512, b"/torch_1_2", 7,
                     os.urandom(64), True, 64, 4096)


def test_an_ipc_handle_travels_as_a_map_of_its_named_fields():
    import msgpack

    from executor.transports.ipc_regions import IpcHandle

    h = _handle()
    wire = msgpack.unpackb(msgpack.packb(h.to_msgpack(), use_bin_type=True), raw=False)
    assert wire["offset"] == 512 and wire["storage_offset"] == 64 and wire["event_sync"]
    assert IpcHandle.from_msgpack(wire) == h
    assert IpcHandle.from_msgpack({**wire, "event_handle": b"", "event_sync": False}) == \
        IpcHandle(**{**wire, "event_handle": b"", "event_sync": False})


@pytest.mark.parametrize("field,value,says", [
    ("device", -1, "0 to 1023"), ("device", 1 << 20, "0 to 1023"),
    ("device", True, "an integer"), ("size", "1", "an integer"),
    ("offset", -512, "0 to"), ("ref_offset", 1 << 63, "0 to"),
    ("handle", b"", "1 to"), ("handle", b"x" * ((1 << 20) + 1), "1 to"),
    ("handle", "abc", "bytes"), ("ref_handle", b"r" * 5000, "1 to 4096"),
    ("event_handle", b"e" * 63, "empty or 64"), ("event_sync", 1, "true or false"),
    ("numel", (1 << 20) - 63, "end within the storage's 1048576 bytes"),
    ("storage_offset", 1 << 20, "end within"),
])
def test_a_bad_field_is_refused_in_one_line_naming_it(field, value, says):
    from executor.transports.ipc_regions import IpcHandle

    wire = {**_handle().to_msgpack(), field: value}
    with pytest.raises(ValueError) as e:
        IpcHandle.from_msgpack(wire, "rank 3's region 0")
    msg = str(e.value)
    assert msg.startswith("rank 3's region 0: CUDA IPC handle field") and says in msg, msg
    named = "numel" if field == "storage_offset" else field  # the region's end is numel's
    assert repr(named) in msg and "\n" not in msg and len(msg) < 300, msg


def test_event_sync_needs_the_event_and_the_map_must_be_whole():
    from executor.transports.ipc_regions import IpcHandle

    wire = _handle().to_msgpack()
    with pytest.raises(ValueError, match="'event_handle' is 0 bytes: with event_sync"):
        IpcHandle.from_msgpack({**wire, "event_handle": b""})
    old = list(wire.values())  # the positional list of earlier versions
    for bad in (old, None, {k: v for k, v in wire.items() if k != "numel"},
                {**wire, "extra": 1}):
        with pytest.raises(ValueError) as e:
            IpcHandle.from_msgpack(bad, "rank 3's region 0")
        assert str(e.value).startswith("rank 3's region 0: a CUDA IPC handle is a map of the "
                                       "fields device, handle,"), e.value
        assert "\n" not in str(e.value)


def test_a_peer_descriptor_is_checked_before_anything_is_touched():
    # no GPU needed: the transport is not built, so any use of its state would raise
    # AttributeError; a malformed descriptor must be refused before that
    from executor.transports.cuda_ipc import CudaIpcTransport

    t = CudaIpcTransport.__new__(CudaIpcTransport)
    good = _handle().to_msgpack()
    for desc, says in (({"mailbox": {}}, "no list of 'regions'"), (None, "no list"),
                       ({"regions": [good, {**good, "numel": -1}], "mailbox": {}},
                        "rank 5's region 1: CUDA IPC handle field 'numel' is -1")):
        with pytest.raises(ValueError, match=says):
            t.import_peer(5, desc)
