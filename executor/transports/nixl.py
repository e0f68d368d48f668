"""NIXL (over UCX) transport: one-sided writes between processes or hosts.

Memory is registered before the agent metadata is exported. Each batch becomes one
prepared NIXL transfer (`prep_xfer_dlist` for both sides + `make_prepped_xfer`) at
connect time; a step re-posts it with `transfer()`. Notifications are NIXL notifs.

The per-write cost: NIXL's UCX backend posts a prepared transfer as one put per
descriptor; over CUDA IPC each put is a `cuMemcpyDtoDAsync` plus an event recorded and
polled, all on the one stream UCX keeps for that peer GPU. With `sgl` (the default) the
backend posts a batch as one scatter-gather put, which UCX's CUDA IPC transport issues as
one `cuMemcpyBatchAsync` with one event. More UCX workers (own streams) changed nothing.
A restarted peer is imported again (`import_peer` replaces the old remote agent) after the
executor released the handles that named it (`release`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ..cleanup import best_effort
from .base import Capabilities, WriteBatch
from .options import NixlOptions


class NixlTransport:
    capabilities = Capabilities()
    """None: a post does not wait for the caller's stream (the executor syncs before it)."""

    def __init__(self, rank: int, namespace: str, options: NixlOptions | None = None) -> None:
        from nixl import nixl_agent, nixl_agent_config

        opts = options or NixlOptions()
        self.rank = rank
        self.name = f"{namespace}-r{rank}-{os.getpid()}-{id(self):x}"
        if opts.sgl:  # read when the UCX backend is created; a caller's setting wins
            os.environ.setdefault("NIXL_UCX_SGL_ENABLE", "1")
        self.agent = nixl_agent(self.name, nixl_agent_config(
            enable_prog_thread=opts.progress_thread, backends=list(opts.backends)))
        self.peers: dict[int, tuple[str, list[int], int]] = {}  # name, addrs, device id
        self.handles: dict[int, tuple[Any, Any, Any]] = {}  # id(xfer) -> (lh, rh, xfer)
        self.leaked = 0  # handles NIXL refused to release (still in flight to a dead peer)
        self.regions: list[torch.Tensor] = []
        self.mem, self.dev, self.reg = "DRAM", 0, None

    def register(self, regions: list[torch.Tensor]) -> None:
        self.regions = regions
        self.mem = "DRAM" if not regions or regions[0].device.type == "cpu" else "VRAM"
        self.dev = max(regions[0].get_device(), 0) if regions else 0
        nonempty = [r for r in regions if r.numel()]
        if nonempty:
            self.reg = self.agent.register_memory(nonempty)

    def export(self) -> dict[str, Any]:
        return {"agent": self.agent.get_agent_metadata(),
                "addrs": [r.data_ptr() for r in self.regions], "dev": self.dev}

    def import_peer(self, peer: int, desc: dict[str, Any]) -> None:
        old = self.peers.pop(peer, None)
        if old is not None:  # a restarted peer: forget the dead process's agent
            # NIXL may have dropped it already
            best_effort(f"forgetting rank {peer}'s old agent", self.agent.remove_remote_agent,
                        old[0])
        name = self.agent.add_remote_agent(desc["agent"])
        self.peers[peer] = (name if isinstance(name, str) else name.decode(),
                            list(desc["addrs"]), int(desc["dev"]))

    def prepare(self, batch: WriteBatch) -> Any:
        keep = batch.nbytes > 0
        if not keep.any():
            return None
        name, addrs, dev = self.peers[batch.peer]
        src_base = np.array([r.data_ptr() for r in self.regions], dtype=np.uint64)
        local = np.stack([src_base[batch.src_region[keep]] + batch.src_offset[keep].astype(
            np.uint64), batch.nbytes[keep].astype(np.uint64),
            np.full(int(keep.sum()), self.dev, dtype=np.uint64)], axis=1)
        remote = np.stack([np.array(addrs, dtype=np.uint64)[batch.dst_region[keep]]
                           + batch.dst_offset[keep].astype(np.uint64),
                           batch.nbytes[keep].astype(np.uint64),
                           np.full(int(keep.sum()), dev, dtype=np.uint64)], axis=1)
        lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, self.mem)
        rh = self.agent.prep_xfer_dlist(name, remote, self.mem)
        idx = np.arange(len(local), dtype=np.int32)
        xfer = self.agent.make_prepped_xfer("WRITE", lh, idx, rh, idx)
        self.handles[id(xfer)] = (lh, rh, xfer)
        return xfer

    def release(self, handle: Any) -> None:
        """Release a prepared batch (its peer restarted, or it failed mid-flight)."""
        if handle is None:
            return
        lh, rh, xfer = self.handles.pop(id(handle))
        for h in (xfer, lh, rh):  # in flight to a dead peer: leave it to UCX
            if not best_effort("releasing a NIXL handle", lambda h=h: h.release() or True,
                               default=False):
                self.leaked += 1

    def post(self, handle: Any) -> None:
        if handle is not None and self.agent.transfer(handle) == "ERR":
            raise RuntimeError(f"rank {self.rank}: NIXL failed to post a write batch")

    def done(self, handle: Any) -> bool:
        if handle is None:
            return True
        state = self.agent.check_xfer_state(handle)
        if state == "ERR":
            raise RuntimeError(f"rank {self.rank}: a NIXL write batch failed")
        return state == "DONE"

    def notify(self, peer: int, msg: bytes) -> None:
        self.agent.send_notif(self.peers[peer][0], msg)

    def notify_landed(self, handles: list[Any], peer: int, msg: bytes) -> bool:
        return False  # no device-side notification: the executor sends it from the host

    def peer_id(self, peer: int) -> str:
        return self.peers[peer][0] if peer in self.peers else ""

    def stats(self) -> dict[str, int]:
        return {"leaked": self.leaked}

    def poll(self) -> list[tuple[str, bytes]]:
        """Each notification with the name of the agent NIXL received it from."""
        return [(a if isinstance(a, str) else a.decode(errors="replace"), m)
                for a, msgs in self.agent.get_new_notifs().items() for m in msgs]

    def close(self) -> None:
        for xfer in list(self.handles.values()):
            self.release(xfer[2])
