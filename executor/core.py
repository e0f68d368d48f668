"""The executor: bind, check, register once, connect once, then replay the plan every step.

`run()` walks the stages and does, per stage, the 7 steps of `schemas/plan.py`:
ready/wait -> packs (and QUANTs) -> writes -> DONE -> wait -> unpacks -> ACK. Everything
a step needs (copy views, prepared write batches, signal lists) is built at `connect()`;
a step only replays it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from schemas.plan import ACK, DONE, PACK, QUANT, READY, UNPACK, RankPlan, load_rank

from . import signals
from .bind import bind
from .check import check_rank_plan
from .copies import Op, prepare_copies
from .errors import PeerMismatchError, PeerTimeoutError
from .quant import prepare_quants
from .rendezvous import open_store
from .transports.base import Store, Transport, WriteBatch

_KIND_NAMES = {READY: "READY", DONE: "DONE (its writes landed)",
               ACK: "ACK (its staging is free)"}


@dataclass(frozen=True, slots=True)
class RunStats:
    rank: int
    """Plan rank, or -1 for a whole in-process world (`run_all_local`)."""
    step: int
    bytes: int
    """Bytes this rank wrote (all ranks' bytes for a world)."""
    seconds: float
    gbps: float
    complete: bool
    """Whether this rank's part of the step finished (targets: weights are whole)."""


@dataclass(slots=True)
class Stage:
    """What one rank does in one stage, prepared once."""

    ready_to: list[int] = field(default_factory=list)
    before: list[tuple[int, int, int]] = field(default_factory=list)  # (stage, kind, peer)
    packs: list[Op] = field(default_factory=list)
    batches: list[tuple[Any, int]] = field(default_factory=list)  # (handle, peer)
    done_to: list[int] = field(default_factory=list)
    after: list[tuple[int, int, int]] = field(default_factory=list)
    unpacks: list[Op] = field(default_factory=list)
    ack_to: list[int] = field(default_factory=list)


def make_transport(kind: str, rank: int, namespace: str, store: Store,
                   device: torch.device) -> Transport:
    if kind == "local":
        from .transports.local import Fabric, LocalTransport
        return LocalTransport(rank, namespace, store if isinstance(store, Fabric) else None)
    if kind == "nixl":
        from .transports.nixl import NixlTransport
        return NixlTransport(rank, namespace)
    if kind == "cuda_ipc":
        from .transports.cuda_ipc import CudaIpcTransport
        return CudaIpcTransport(rank, namespace, store, device)
    if kind == "uccl":
        from .transports.uccl import UcclTransport
        return UcclTransport(rank, namespace, store, device)
    raise ValueError(f"transport {kind!r} is unknown; use 'nixl', 'uccl', 'cuda_ipc' or 'local'")


class Executor:
    def __init__(self, header: dict[str, Any], plan: RankPlan,
                 tensors: dict[str, torch.Tensor], transport: str = "nixl",
                 rendezvous: object = None, timeout_s: float = 60.0,
                 max_inflight: int = 8) -> None:
        check_rank_plan(plan)
        self.plan, self.rank, self.timeout_s = plan, plan.rank, timeout_s
        self.max_inflight = max(1, max_inflight)
        self.fingerprint = str(header.get("fingerprint", ""))
        self.tag = signals.fingerprint_tag(self.fingerprint)
        self.namespace = "rplan"  # not per plan: a peer on another plan must be told so
        self.regions = bind(plan.rank, plan.regions, tensors)
        self.device = device = self.regions[0].device if self.regions else torch.device("cpu")
        if rendezvous is None and transport == "local":
            from .transports.local import FABRIC
            rendezvous = FABRIC
        if rendezvous is None:
            raise ValueError(f"transport {transport!r} needs rendezvous='host:port' (rank 0 "
                             "hosts a TCPStore there) or a torch Store")
        self.store = open_store(rendezvous, self.rank, timeout_s)
        self.transport = make_transport(transport, self.rank, self.namespace, self.store, device)
        self.inbox = signals.Inbox(self.tag)
        self.stages: list[Stage] = []
        self.step, self.complete, self.registered = 0, False, False
        self.bytes_per_step = int(plan.writes["nbytes"].sum())

    @staticmethod
    def load(path: str, rank: int, tensors: dict[str, torch.Tensor], transport: str = "nixl",
             rendezvous: object = None, timeout_s: float = 60.0,
             max_inflight: int = 8) -> Executor:
        """Read rank `rank` of the plan at `path`, bind `tensors`, register and connect."""
        header, plan = load_rank(path, rank)
        ex = Executor(header, plan, tensors, transport, rendezvous, timeout_s, max_inflight)
        ex.register()
        ex.connect()
        return ex

    # ------------------------------------------------------------------ once

    def register(self) -> None:
        """Register the regions with the transport and publish them (once)."""
        if self.registered:
            return
        self.transport.register(self.regions)
        info = {"fingerprint": self.fingerprint, "sizes": [r.nbytes for r in self.plan.regions],
                "desc": self.transport.export()}
        self.store.set(f"{self.namespace}/rank/{self.rank}", msgpack.packb(info))
        self.registered = True

    def _peer_info(self, peer: int) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while (raw := self.store.get(f"{self.namespace}/rank/{peer}")) is None:
            if time.monotonic() > deadline:
                raise PeerTimeoutError(self.rank, peer, "publish its regions (load the plan)",
                                       self.timeout_s)
            time.sleep(0.01)
        return msgpack.unpackb(raw)

    def connect(self) -> None:
        """Check and import every peer, then prepare every stage's ops (once)."""
        self.register()
        p = self.plan
        peers = sorted(set(p.writes["dst_rank"].tolist()) | set(p.signals["peer"].tolist())
                       | set(p.waits["peer"].tolist()))
        expected = dict(p.peer_regions)
        for peer in peers:
            info = self._peer_info(peer)
            if info["fingerprint"] != self.fingerprint:
                raise PeerMismatchError(
                    f"rank {self.rank}: peer rank {peer} loaded plan {info['fingerprint'][:16]!r}"
                    f", this rank {self.fingerprint[:16]!r}; load the same plan on every rank")
            if peer in expected and tuple(info["sizes"]) != expected[peer]:
                raise PeerMismatchError(
                    f"rank {self.rank}: peer rank {peer} exported regions of {info['sizes']} "
                    f"bytes, the plan expects {list(expected[peer])}; bind the tensors the "
                    "plan was compiled for on that rank")
            self.transport.import_peer(peer, info["desc"])
        self.stages = [self._prepare_stage(s) for s in range(p.stages)]

    def _prepare_stage(self, s: int) -> Stage:
        p, st = self.plan, Stage()
        for table, sent in ((p.signals, True), (p.waits, False)):
            rows = np.flatnonzero(table["stage"] == s)
            for kind, peer in zip(table["kind"][rows].tolist(), table["peer"][rows].tolist()):
                if sent:
                    {READY: st.ready_to, DONE: st.done_to, ACK: st.ack_to}[kind].append(peer)
                else:
                    (st.after if kind == DONE else st.before).append((s, kind, peer))
        c = p.copies
        st.packs = prepare_copies(c, np.flatnonzero((c["stage"] == s) & (c["kind"] == PACK)),
                                  self.regions)
        st.packs += prepare_quants(
            c, np.flatnonzero((c["stage"] == s) & (c["kind"] == QUANT)), self.regions)
        st.unpacks = prepare_copies(
            c, np.flatnonzero((c["stage"] == s) & (c["kind"] == UNPACK)), self.regions)
        w, b = p.writes, p.batches
        for i in np.flatnonzero(b["stage"] == s):
            rows = np.arange(int(b["start"][i]), int(b["stop"][i]))
            dst = w["dst_rank"][rows]
            for peer in dict.fromkeys(dst.tolist()):
                r = rows[dst == peer]
                batch = WriteBatch(peer, *(w[k][r].astype(np.int64) for k in (
                    "src_region", "src_offset", "dst_region", "dst_offset", "nbytes")))
                st.batches.append((self.transport.prepare(batch), peer))
        return st

    # ------------------------------------------------------------------ every step

    def run(self) -> RunStats:
        """One step: walk every stage; returns when this rank's part is done."""
        t0 = time.perf_counter()
        self.begin_step()
        for s in range(len(self.stages)):
            self.ready(s)
            self.send_half(s)
            self.recv_half(s)
        return self.end_step(t0)

    def begin_step(self) -> None:
        self.step += 1
        self.complete = False
        self.inbox.drop_before(self.step)

    def end_step(self, t0: float) -> RunStats:
        if self.device.type == "cuda":  # unpacks are queued: the weights are whole after this
            torch.cuda.current_stream(self.device).synchronize()
        self.complete = True
        seconds = time.perf_counter() - t0
        return RunStats(self.rank, self.step, self.bytes_per_step, seconds,
                        self.bytes_per_step / max(seconds, 1e-9) / 1e9, True)

    def ready(self, s: int) -> None:
        """Step 1, first half: send this stage's READY signals."""
        self._signal(self.stages[s].ready_to, s, READY)

    def send_half(self, s: int, timeout_s: float | None = None) -> None:
        """Steps 1-4 of stage `s` after `ready`: wait READY/ACK, packs, writes, DONE."""
        st = self.stages[s]
        self._wait(st.before, timeout_s)
        for op in st.packs:
            op()
        self._write(st.batches, s, timeout_s)
        self._signal(st.done_to, s, DONE)

    def recv_half(self, s: int, timeout_s: float | None = None) -> None:
        """Steps 5-7 of stage `s`: wait DONE, unpacks, ACK."""
        st = self.stages[s]
        self._wait(st.after, timeout_s)
        for op in st.unpacks:
            op()
        self._signal(st.ack_to, s, ACK)

    def _signal(self, peers: list[int], stage: int, kind: int) -> None:
        for peer in peers:
            self.transport.notify(peer, signals.encode(self.tag, self.step, stage, kind,
                                                       self.rank))

    def _wait(self, waits: list[tuple[int, int, int]], timeout_s: float | None) -> None:
        if not waits:
            return
        keys = [signals.expected(self.step, s, kind, peer) for s, kind, peer in waits]
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline, nap = time.monotonic() + timeout_s, 5e-5
        while True:
            self.inbox.add(self.transport.poll(), self.step)
            missing = self.inbox.take(keys)
            if not missing:
                return
            if time.monotonic() >= deadline:
                _, stage, kind, peer = missing[0]
                raise PeerTimeoutError(self.rank, peer, f"send {_KIND_NAMES[kind]} of stage "
                                       f"{stage}, step {self.step}", timeout_s)
            time.sleep(nap)  # backs off to 1 ms: never a busy loop
            nap = min(nap * 2, 1e-3)

    def _write(self, batches: list[tuple[Any, int]], s: int, timeout_s: float | None) -> None:
        inflight: deque[tuple[Any, int]] = deque()
        for handle, peer in batches:
            if len(inflight) >= self.max_inflight:
                self._landed(*inflight.popleft(), s, timeout_s)
            self.transport.post(handle)
            inflight.append((handle, peer))
        while inflight:
            self._landed(*inflight.popleft(), s, timeout_s)

    def _landed(self, handle: Any, peer: int, s: int, timeout_s: float | None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline, nap = time.monotonic() + timeout_s, 2e-5
        while not self.transport.done(handle):
            if time.monotonic() >= deadline:
                raise PeerTimeoutError(self.rank, peer, f"complete the writes of stage {s}",
                                       timeout_s)
            time.sleep(nap)  # short naps: some transports progress only when polled
            nap = min(nap * 2, 2e-4)

    def close(self) -> None:
        self.transport.close()


def load(path: str, rank: int, tensors: dict[str, torch.Tensor], transport: str = "nixl",
         rendezvous: object = None, timeout_s: float = 60.0, max_inflight: int = 8) -> Executor:
    """Load rank `rank` of a plan, bind `tensors`, register once and connect to the peers."""
    return Executor.load(path, rank, tensors, transport, rendezvous, timeout_s, max_inflight)


def run(plan: Executor) -> RunStats:
    """One step of a loaded plan (`load`): source ranks push, target ranks receive."""
    return plan.run()
