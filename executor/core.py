"""The executor: bind, check, register once, connect once, then replay the plan every step.

`run()` walks the stages and does, per stage, the 7 steps of `schemas/plan.py`:
ready/wait -> packs (and QUANTs) -> writes -> DONE -> wait -> unpacks -> ACK, with its two
overlaps: packs run early where `schemas/protocol.py` allows, and writes stay in flight
across a stage boundary where the rank receives nothing (`window.py`). Everything a step
needs (copy views, prepared write batches, signal lists) is built at `connect()`; a step
only replays it.

Failures and recovery (docs/reliability.md). A step that cannot finish raises within
`timeout_s`: `PeerTimeoutError` (or its subclass `PeerLostError` when the transport reports
the peer gone) naming the peer; `complete` stays False, so a target knows its weights are
not whole. Nothing is re-planned; the next `run()` recovers:

1. Incarnations. Every `Executor` draws a random 64-bit incarnation id. It is published
   with the rank's descriptors (`<ns>/rank/<r>`) and carried by every signal; a signal
   counts only if its incarnation is the one this rank imported for the sender. Signals of
   a dead process, or of a restarted one not imported yet, never satisfy a wait (the latter
   are held and admitted once it is imported).
2. Re-import. A rank restarted after a crash loads the plan again: it registers, publishes
   its new descriptors and incarnation, and connects (the survivors' entries are still in
   the store, so it needs nothing from them but their presence). A surviving rank, at the
   start of the `run()` after a failed one (or as soon as it sees a signal of an unknown
   incarnation), reads every peer's entry; for a peer whose incarnation changed it checks
   the fingerprint and sizes again, re-imports the descriptors and re-prepares the write
   batches to that peer (the old ones are released).
3. In-flight writes. Batches still in flight when a step failed are waited for (briefly)
   and, if not finished, released and prepared again before anything is re-posted.
4. Steps. Signals carry the step number; a rank publishes the step it runs next
   (`<ns>/step/<r>`, one store write per step) when it registers and when a step ends or
   fails. A restarted rank (its rank's entry was already in the store) runs the largest
   step its peers published; a survivor recovering runs the largest of that and its last
   completed step + 1, so the next `run()` has the same number everywhere. (A rank that
   failed a step no peer started, e.g. one it ran alone, runs the same number again: its
   `ABORT` voided the signals it sent in the failed attempt, so no peer can finish that
   step without it. A caller that knows its training step can pass `run(step=n)` on every
   rank instead.)
The rendezvous store must outlive the ranks (host it in the launcher, not in rank 0) for a
crashed rank 0 to come back. Re-import needs a transport whose `import_peer` can be called
again for a new process: `nixl` and `local` (not yet `uccl`, `cuda_ipc`: their store
mailboxes count messages per pair from 0).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from schemas.header import PlanHeader
from schemas.identity import check_against_plan
from schemas.integrity import plan_key as read_key
from schemas.integrity import rank_digest
from schemas.plan import ACK, DONE, PACK, QUANT, READY, UNPACK, RankPlan, load_rank
from schemas.protocol import Overlap, carries

from . import signals
from .bind import bind
from .check import check_against_header, check_rank_plan, check_staging
from .copies import Op, prepare_copies
from .errors import PeerLostError, PeerMismatchError, PeerTimeoutError
from .quant import prepare_quants
from .rendezvous import open_store
from .transports.base import Store, Transport, WriteBatch
from .window import Window

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
    batches: list[list[Any]] = field(default_factory=list)  # [handle, peer, WriteBatch]
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
    def __init__(self, header: PlanHeader, plan: RankPlan,
                 tensors: dict[str, torch.Tensor], transport: str = "nixl",
                 rendezvous: object = None, timeout_s: float = 60.0,
                 max_inflight: int = 8) -> None:
        check_rank_plan(plan)
        check_against_header(plan, header)
        check_staging(plan, tensors)  # before bind allocates it
        self.plan, self.rank, self.timeout_s = plan, plan.rank, timeout_s
        self.header = header  # peers' blob digests (schemas/integrity.py)
        self.max_inflight = max(1, max_inflight)
        self.fingerprint = header.fingerprint
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
        self.incarnation = int.from_bytes(os.urandom(8), "little")
        self.inbox = signals.Inbox(self.tag, self.incarnation, self.rank)
        self.window = Window(self.rank, self.transport, self.max_inflight,
                             lambda s: self._signal(self.stages[s].done_to, s, DONE))
        self.stages: list[Stage] = []
        self.step, self.complete, self.registered = 0, False, False
        self.failed = False  # the last step raised: the next one recovers first
        self.last_complete_step = 0
        self.pending: list[list[Any]] = []  # batches in flight when a step failed
        self.register_calls = 0  # transport registrations (once per process, ever)
        self.reimports = 0  # peers re-imported after they restarted
        self.reprepared = 0  # batches released and prepared again after a failed step
        self.peers: list[int] = []
        self.prepacked: list[bool] = []  # stage s packs during stage s-1's writes
        self.carries: list[bool] = []  # stage s may end with its writes in flight
        self.rejoined = False
        self.bytes_per_step = int(plan.writes["nbytes"].sum())

    @staticmethod
    def load(path: str, rank: int, tensors: dict[str, torch.Tensor], transport: str = "nixl",
             rendezvous: object = None, timeout_s: float = 60.0,
             max_inflight: int = 8, plan_key: bytes | str | None = None,
             identity: dict | None = None) -> Executor:
        """Read rank `rank` of the plan at `path`, bind `tensors`, register and connect.
        `plan_key`: the plan must be signed with this key (bytes, or a key file's path).
        `identity` (`schemas/identity.py`): refused unless it is the plan's for `rank`."""
        header, plan = load_rank(path, rank, None if plan_key is None else read_key(plan_key))
        check_against_plan(header, rank, identity, path)  # before anything is registered
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
        self.register_calls += 1
        info = {"fingerprint": self.fingerprint, "sizes": [r.nbytes for r in self.plan.regions],
                "desc": self.transport.export(), "inc": self.incarnation,
                "digest": rank_digest(self.header, self.rank)}
        key = f"{self.namespace}/rank/{self.rank}"
        self.rejoined = self.store.get(key) is not None  # an earlier process had this rank
        self._publish_step()
        self.store.set(key, msgpack.packb(info))
        self.registered = True

    def _publish_step(self) -> None:
        """Publish the step this rank runs next (`<ns>/step/<rank>`)."""
        self.store.set(f"{self.namespace}/step/{self.rank}", str(self.step + 1).encode())

    def _peers_next_step(self) -> int:
        """The largest step the peers run next, per the store (0 if none published)."""
        steps = [0]
        for peer in self.peers:
            raw = self.store.get(f"{self.namespace}/step/{peer}")
            if raw is not None and raw.isdigit():
                steps.append(int(raw))
        return max(steps)

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
        for peer in peers:
            info = self._peer_info(peer)
            self._check_peer(peer, info)
            try:
                self.transport.import_peer(peer, info["desc"])
            except Exception as e:  # noqa: BLE001 - e.g. NIXL cannot reach a dead process
                raise PeerLostError(self.rank, peer, "import its published descriptors", e) \
                    from e
            self.inbox.set_incarnation(peer, int(info.get("inc", 0)))
        self.peers = peers
        if self.rejoined:  # a restarted rank joins at its peers' step (module doc, step 4)
            self.step = max(self.step, self._peers_next_step() - 1)
            self._publish_step()
        self.stages = [self._prepare_stage(s) for s in range(p.stages)]
        self.overlap = Overlap(p)
        self.prepacked = self.overlap.prepacked.tolist()
        self.carries = carries(p).tolist()  # stage s may end with its writes in flight

    def _check_peer(self, peer: int, info: dict[str, Any]) -> None:
        expected = dict(self.plan.peer_regions)
        if info["fingerprint"] != self.fingerprint:
            raise PeerMismatchError(
                f"rank {self.rank}: peer rank {peer} loaded plan {info['fingerprint'][:16]!r}"
                f", this rank {self.fingerprint[:16]!r}; load the same plan on every rank",
                peer=peer)
        if info.get("digest", b"") != rank_digest(self.header, peer):
            raise PeerMismatchError(
                f"rank {self.rank}: peer rank {peer} holds a different plan for itself than "
                "this rank's plan says (its blob digest differs: another or a tampered plan "
                "file); load the same plan file on every rank", peer=peer)
        sizes = list(info["sizes"])
        wrong = [(r, n) for r, n in expected.get(peer, ())
                 if r >= len(sizes) or sizes[r] != n]
        if wrong:
            r, n = wrong[0]
            got = sizes[r] if r < len(sizes) else "no such region"
            raise PeerMismatchError(
                f"rank {self.rank}: peer rank {peer} exported region {r} of {got} bytes, "
                f"the plan expects {n} ({len(wrong)} region(s) differ); bind the tensors "
                "the plan was compiled for on that rank", peer=peer)

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
                st.batches.append([self.transport.prepare(batch), peer, batch])
        return st

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        """Before a step that follows a failure (module doc, recovery steps 2-4)."""
        self._settle_pending()
        self._refresh_peers()
        try:  # a failed step is run again only if no peer has started it (module doc)
            self.step = max(self.last_complete_step, self._peers_next_step() - 1)
        except Exception:  # noqa: BLE001 - the store may be gone; keep our own count
            pass
        self.failed = False

    def _settle_pending(self) -> None:
        """Batches in flight when a step failed: done, or released and prepared again."""
        deadline = time.monotonic() + min(self.timeout_s, 1.0)
        for entry in self.pending:
            while True:
                try:
                    if self.transport.done(entry[0]):
                        break
                    failed = False
                except Exception:  # noqa: BLE001 - a failed batch: prepare it again
                    failed = True
                if failed or time.monotonic() >= deadline:
                    self._reprepare(entry)
                    break
                time.sleep(1e-3)
        self.pending = []

    def _reprepare(self, entry: list[Any]) -> None:
        self.reprepared += 1
        release = getattr(self.transport, "release", None)
        if release is not None:
            release(entry[0])
        entry[0] = self.transport.prepare(entry[2])

    def _refresh_peers(self) -> None:
        """Re-import every peer whose published incarnation changed (it restarted)."""
        for peer in self.peers:
            try:
                raw = self.store.get(f"{self.namespace}/rank/{peer}")
            except Exception:  # noqa: BLE001 - the store may be gone: nothing to re-import
                return
            if raw is None:
                continue
            info = msgpack.unpackb(raw)
            inc = int(info.get("inc", 0))
            if inc == self.inbox.incarnations.get(peer):
                continue
            self._check_peer(peer, info)
            entries = [e for st in self.stages for e in st.batches if e[1] == peer]
            release = getattr(self.transport, "release", None)
            for e in entries:
                if release is not None:
                    release(e[0])
                e[0] = None
            self.transport.import_peer(peer, info["desc"])
            for e in entries:
                e[0] = self.transport.prepare(e[2])
            self.inbox.set_incarnation(peer, inc)
            self.reimports += 1
        self.inbox.foreign = False

    # ------------------------------------------------------------------ every step

    def run(self, step: int | None = None) -> RunStats:
        """One step: walk every stage; returns when this rank's part is done.

        Raises `PeerTimeoutError` (naming the peer) within `timeout_s` when a peer is gone;
        `complete` is then False and the next `run()` recovers (module doc). `step`: the
        caller's step number (the same on every rank), or None to count steps here."""
        t0 = time.perf_counter()
        self.begin_step(step)
        try:
            for s in range(len(self.stages)):
                self.ready(s)
                self.send_half(s)
                self.recv_half(s)
        except BaseException as e:
            self.fail(getattr(e, "peer", None))
            raise
        return self.end_step(t0)

    def begin_step(self, step: int | None = None) -> None:
        self.complete = False
        if self.failed or self.inbox.foreign:
            self._recover()
        self.step = self.step + 1 if step is None else step
        self.inbox.drop_before(self.step)

    def fail(self, lost: int | None = None) -> None:
        """Mark the step failed: tell every peer which rank was lost (its signals of this step
        are void; the others stop waiting for this one), publish the step so that a
        restarted peer can join."""
        self.failed, self.complete = True, False
        self.pending += self.window.abandon()  # settled before the next step posts again
        if lost is not None:
            for peer in self.peers:
                msg = signals.encode(self.tag, self.incarnation,
                                     self.inbox.incarnations.get(peer, 0), self.step, lost,
                                     signals.ABORT, self.rank)
                try:
                    self.transport.notify(peer, msg)
                except Exception:  # noqa: BLE001 - best effort; their timeouts still hold
                    pass
        try:
            self._publish_step()
        except Exception:  # noqa: BLE001 - the store may be gone too; the timeout was raised
            pass

    def end_step(self, t0: float) -> RunStats:
        if self.device.type == "cuda":  # unpacks are queued: the weights are whole after this
            torch.cuda.current_stream(self.device).synchronize()
        self.complete = True
        self.last_complete_step = self.step
        seconds = time.perf_counter() - t0
        try:  # where a restarted peer joins (module doc, recovery step 4)
            self._publish_step()
        except Exception:  # noqa: BLE001 - the store may be gone; the weights are whole
            pass
        return RunStats(self.rank, self.step, self.bytes_per_step, seconds,
                        self.bytes_per_step / max(seconds, 1e-9) / 1e9, True)

    def ready(self, s: int) -> None:
        """Step 1, first half: send this stage's READY signals."""
        self._signal(self.stages[s].ready_to, s, READY)

    def send_half(self, s: int, timeout_s: float | None = None) -> None:
        """Steps 1-4 of stage `s` after `ready`: wait READY/ACK, packs, writes, DONE.

        The packs of the next stage run here too, once the first writes are posted, where
        `schemas.protocol` allows it. When nothing arrives for this rank in stage `s`, its
        last writes may still be in flight when the next stage starts (`window.py`): their
        DONE goes out as they land."""
        st = self.stages[s]
        timeout = self.timeout_s if timeout_s is None else timeout_s
        early = len(self.window) > 0  # writes of stage s-1 still in flight
        if early and not (self._take(st.before) and (self.prepacked[s] or not st.packs)):
            self.window.drain(timeout)  # a wait, or packs that may touch their staging
            early = False
        if not early:
            self._wait(st.before, timeout_s)
        if not self.prepacked[s]:  # else they ran while stage s-1's writes were in flight
            self._pack(s)
        if st.packs:
            self._sync()  # writes read what the packs wrote: their kernels must be done
        nxt = s + 1 if s + 1 < len(self.stages) and self.prepacked[s + 1] else -1
        for i, entry in enumerate(st.batches):
            if i == self.max_inflight and nxt >= 0:
                self._prepack(nxt, timeout)
                nxt = -1
            self.window.post(entry, s, timeout)
        if nxt >= 0:
            self._prepack(nxt, timeout)
        self.window.close(s)
        self.window.reap_landed()
        if not self.carries[s]:
            self.window.drain(timeout)  # the next stage starts with nothing in flight

    def _pack(self, s: int) -> None:
        for op in self.stages[s].packs:
            op()

    def _prepack(self, s: int, timeout_s: float) -> None:
        """Stage `s`'s packs, early: `schemas.protocol` made them safe against what stages
        s-1 and s-2 read; writes of older stages still in flight that read what they
        write land first."""
        for k in self.overlap.blockers(s, self.window.stages()):
            self.window.drain_stage(k, timeout_s)
        self._pack(s)

    def _take(self, waits: list[tuple[int, int, int]]) -> bool:
        """Whether every signal of `waits` has arrived (they are consumed if so)."""
        if not waits:
            return True
        self.inbox.add(self.transport.poll(), self.step)
        return not self.inbox.take([signals.expected(self.step, s, kind, peer)
                                    for s, kind, peer in waits])

    def recv_half(self, s: int, timeout_s: float | None = None) -> None:
        """Steps 5-7 of stage `s`: wait DONE, unpacks, ACK."""
        st = self.stages[s]
        self._wait(st.after, timeout_s)
        for op in st.unpacks:
            op()
        if st.unpacks:
            self._sync()  # ACK frees staging the unpacks read; and the weights are whole
        self._signal(st.ack_to, s, ACK)

    def _sync(self) -> None:
        """Wait for the packs/unpacks queued on this rank's current CUDA stream (async
        kernels; a peer must not read or overwrite their staging before they finish).
        Only that stream: a transport's copies of earlier writes may still be running."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _signal(self, peers: list[int], stage: int, kind: int) -> None:
        for peer in peers:
            msg = signals.encode(self.tag, self.incarnation, self.inbox.incarnations[peer],
                                 self.step, stage, kind, self.rank)
            try:
                self.transport.notify(peer, msg)
            except Exception as e:  # noqa: BLE001 - transports raise their own types
                raise PeerLostError(self.rank, peer, f"send {_KIND_NAMES[kind]} of stage "
                                    f"{stage}", e) from e

    def _wait(self, waits: list[tuple[int, int, int]], timeout_s: float | None) -> None:
        if not waits:
            return
        keys = [signals.expected(self.step, s, kind, peer) for s, kind, peer in waits]
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline, nap = time.monotonic() + timeout_s, 5e-5
        while True:
            self.inbox.add(self.transport.poll(), self.step)
            if self.inbox.foreign:  # a restarted peer already signals: import it now
                self._refresh_peers()
            missing = self.inbox.take(keys)
            if not missing:
                return
            if (aborted := self.inbox.abort_of(self.step, missing)) is not None:
                sender, lost = aborted
                raise PeerTimeoutError(self.rank, lost, f"take part in step {self.step} (rank "
                                       f"{sender} lost it and gave up the step)", timeout_s)
            if time.monotonic() >= deadline:
                _, stage, kind, peer = missing[0]
                raise PeerTimeoutError(self.rank, peer, f"send {_KIND_NAMES[kind]} of stage "
                                       f"{stage}, step {self.step}", timeout_s)
            time.sleep(nap)  # backs off to 0.2 ms: never a busy loop, and not late
            nap = min(nap * 2, 2e-4)

    def close(self) -> None:
        self.transport.close()


def load(path: str, rank: int, tensors: dict[str, torch.Tensor], transport: str = "nixl",
         rendezvous: object = None, timeout_s: float = 60.0, max_inflight: int = 8,
         plan_key: bytes | str | None = None, identity: dict | None = None) -> Executor:
    """Load rank `rank` of a plan, bind `tensors`, register once and connect to the peers.
    `plan_key`: refuse a plan not signed with this key. With `identity` (this process's
    coordinates, `schemas/identity.py`), a plan rank with other coordinates is refused
    (`IdentityError`, naming both) before registration."""
    return Executor.load(path, rank, tensors, transport, rendezvous, timeout_s, max_inflight,
                         plan_key, identity)


def run(plan: Executor, step: int | None = None) -> RunStats:
    """One step of a loaded plan (`load`): source ranks push, target ranks receive."""
    return plan.run(step)
