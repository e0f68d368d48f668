"""A peer's `cuda_ipc` handles are checked against the plan's regions of that peer before
any pointer is made of them (`ipc_regions.check_desc`, run by the executor at connect
through `transports.base.check_peer_desc`): a handle whose `numel` is not the plan's region
size, or whose allocation offset puts the storage past the device's memory, is refused in
one line naming the peer, the region and the field (any machine: no GPU is touched); on
another transport the hook checks nothing."""

from __future__ import annotations

import os

import pytest

from executor.transports.base import check_peer_desc
from executor.transports.cuda_ipc import CudaIpcTransport
from executor.transports.ipc_regions import IpcHandle, check_desc

MIB = 1 << 20
DEVICE = 80 << 30


def _desc(**fields) -> dict:
    base = dict(device=0, handle=bytes([3]) + b"c" + os.urandom(64), size=2 * MIB, offset=512,
                ref_handle=b"/torch_1_2", ref_offset=7, event_handle=b"", event_sync=False,
                storage_offset=0, numel=MIB)
    regions = [IpcHandle(**base).to_msgpack(), IpcHandle(**dict(base, **fields)).to_msgpack()]
    return {"regions": regions, "mailbox": {}}


PLAN = ((3, ((0, MIB), (1, MIB))),)  # this rank's plan: peer 3's regions 0 and 1, 1 MiB each


def test_handles_as_the_plan_states_pass() -> None:
    check_desc(3, _desc(), dict(PLAN)[3], lambda d: DEVICE)
    check_peer_desc(object.__new__(CudaIpcTransport), 3, _desc(), PLAN)


@pytest.mark.parametrize("fields,says", [
    (dict(numel=1), "field 'numel' is 1: the plan's region is 1048576 bytes"),
    (dict(numel=MIB // 2), "the plan's region is 1048576 bytes"),
    (dict(offset=1 << 40), "field 'offset' is 1099511627776"),
])
def test_a_handle_unlike_the_plans_region_is_refused_before_any_pointer(fields, says) -> None:
    with pytest.raises(ValueError) as e:
        check_desc(3, _desc(**fields), dict(PLAN)[3], lambda d: DEVICE)
    msg = str(e.value)
    assert "\n" not in msg and "rank 3's region 1" in msg and says in msg


def test_the_executor_path_refuses_naming_the_peer() -> None:
    with pytest.raises(ValueError) as e:
        check_peer_desc(object.__new__(CudaIpcTransport), 3, _desc(numel=1), PLAN)
    assert "rank 3's region 1" in str(e.value) and "numel" in str(e.value)
    check_peer_desc(object(), 3, _desc(numel=1), PLAN)  # not cuda_ipc: not its descriptor
    with pytest.raises(ValueError, match="exported 1 region handles, the plan writes "
                                         "region 1"):
        check_peer_desc(object.__new__(CudaIpcTransport), 3,
                        {"regions": _desc()["regions"][:1], "mailbox": {}}, PLAN)
