"""The executor: bind, check, register once, connect once, then replay the plan every step.

`run()` walks the stages and does, per stage, the 7 steps of `schemas/plan.py`:
ready/wait -> packs (and QUANTs) -> writes -> DONE -> wait -> unpacks -> ACK, with its two
overlaps: packs run early where `schemas/protocol.py` allows, and writes stay in flight
across a stage boundary where the rank receives nothing (`window.py`). Everything a step
needs (copy views, prepared write batches, signal lists) is built at `connect()`; a step
only replays it.

Beside the interpreter: `control.py` (the rank's sealed store records and its lease),
`auth.py` (the job secret), `signals.py` (MACed signals, the inbox), and the parts the
executor holds, each owning its state: `waits.py` (`Signals`: sending and awaiting them),
`recovery.py` (`Recovery`: what the next `run()` does after a failed one), `window.py`
(`Window`: writes in flight).

A step that cannot finish raises within `timeout_s` (plus the time to tell a dead rank from
a blocked one): `PeerTimeoutError`, `PeerLostError` (the transport reported the peer gone)
or `PeerAbortError` (a peer gave up the step and names the rank it lost); `.peer` is the
rank to blame. `complete` stays False, so a target knows its weights are not whole. The
next `run()` recovers (`recovery.py`, docs/reliability.md).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from schemas.header import PlanHeader
from schemas.integrity import plan_key as read_key
from schemas.integrity import rank_digest
from schemas.placement import Placement
from schemas.plan import ACK, DONE, READY, SLOT_ACK, RankPlan, load_rank
from schemas.protocol import Overlap, carries

from . import signals
from .auth import keys_from
from .bind import bind
from .blame import Blame
from .check import check_against_header, check_rank_plan, check_rank_verify, check_staging
from .cleanup import best_effort
from .control import Control
from .errors import PeerLostError, PeerMismatchError, PeerTimeoutError, PlanSwitchError
from .gpu.graphs import device_sync
from .options import LoadOptions
from .pipeline import SHARES, beside_quants, groups, link
from .plan_switch import refusal
from .recovery import Recovery
from .rendezvous import open_store
from .stages import Stage, prepare_stage
from .stats import RunStats, received_bytes
from .transports import make_transport
from .transports.base import Prepared, check_peer_desc
from .trust import check_identity
from .waits import Sender, Signals
from .window import Window


class Executor:
    def __init__(self, header: PlanHeader, plan: RankPlan,
                 tensors: dict[str, torch.Tensor], options: LoadOptions | None = None,
                 **fields: Any) -> None:
        """Rank `plan.rank`'s executor, bound to `tensors` (not yet registered or
        connected: `load` does both). `options`/`fields`: `LoadOptions` (its `plan_key`,
        `identity` and `no_identity` are `load`'s to check, before this)."""
        o = self.options = LoadOptions.of(options, fields)
        transport, rendezvous, timeout_s = o.transport, o.rendezvous, o.timeout_s
        secret, insecure = o.secret, o.insecure
        check_rank_plan(plan)
        check_rank_verify(plan, header)  # what verify refuses on this rank's part alone
        check_against_header(plan, header)
        check_staging(plan, tensors, header, o.max_staging_bytes)  # before bind allocates it
        self.plan, self.rank, self.timeout_s, self.header = plan, plan.rank, timeout_s, header
        self.max_inflight = max(1, o.max_inflight)
        self.pack_groups = len(SHARES) if o.pack_groups is None else max(0, o.pack_groups)
        self.fingerprint = header.fingerprint
        self.tag = signals.fingerprint_tag(self.fingerprint)
        self.namespace = "rplan"  # not per plan: a peer on another plan must be told so
        make = make_transport(transport, o.transport_options)  # names checked before anything
        self.regions = bind(plan.rank, plan.regions, tensors)
        self.device = device = self.regions[0].device if self.regions else torch.device("cpu")
        if transport == "local":
            from .transports.local import FABRIC, Fabric
            rendezvous = FABRIC if rendezvous is None else rendezvous
            if not isinstance(rendezvous, Fabric):
                raise ValueError(f"rank {self.rank}: transport 'local' runs every rank in one "
                                 "process (a Fabric); across processes use transport='nixl'")
            secret = rendezvous.secret if secret is None and not insecure else secret
        if rendezvous is None:
            raise ValueError(f"transport {transport!r} needs rendezvous='host:port' (rank 0 "
                             "hosts a TCPStore there) or a torch Store")
        self.keys = keys_from(secret, insecure, self.rank)
        self.store = open_store(rendezvous, self.rank, timeout_s)
        self.transport = make(self.rank, self.namespace, self.store, device)
        self.ordered_posts = self.transport.capabilities.ordered_posts
        """Posted writes run after the kernels queued before them on the current stream."""
        self.one_stream = self.transport.capabilities.one_stream
        """Every rank's kernels and copies queue on one stream of one process (`local`)."""
        self.incarnation = int.from_bytes(os.urandom(8), "little")
        self.control = Control(self.store, self.keys, self.namespace, self.rank,
                               self.incarnation, timeout_s)
        self.live_lease = transport != "local"  # one process holds every local rank
        self.inbox = signals.Inbox(self.tag, self.incarnation, self.rank, self.keys)
        self.world = header.world
        self.blame = Blame(self.control, self.world, self.rank, self.live_lease)
        self.stages: list[Stage] = []
        self.overlap: Overlap | None = None
        self.prepacked: list[bool] = []  # stage s packs during stage s-1's writes
        self.carries: list[bool] = []  # stage s may end with its writes in flight
        self.quiet: list[bool] = []  # stage s only awaits DONEs (`_quiet`)
        self.ready_first = False
        """A step starts by sending stage 0's READYs (its running record is handed after them)."""
        self.peers: list[int] = []
        self.step, self.complete, self.registered = 0, False, False
        self.failed = False  # the last step raised: the next one recovers first
        self.last_complete_step = 0
        self.register_calls = 0  # transport registrations (once per process, ever)
        self.imported: dict[int, Any] = {}  # peer -> the descriptors imported for it
        self.exported: dict[str, Any] = {}  # this rank's, published at registration
        self.switches = 0  # plans switched to in place (`switch_plan`)
        self.rejoined = False
        self.recovery = Recovery(self.rank, self.control, self.transport, self.inbox, timeout_s,
                                 self.check_peer, self.import_peer, self.batches_to)
        self.signals = Signals(Sender(self.rank, self.tag, self.incarnation, self.keys, device),
                               self.transport, self.inbox, self.blame,
                               self.recovery.refresh_peers)
        hand_off = self.transport.capabilities.notify_landed
        self.window = Window(self.rank, self.transport, self.max_inflight, self._landed,
                             (lambda s, e: self._hand_off(s, e)) if hand_off else None,
                             self.signals.ahead)  # writes in flight: the next step's head
        self.bytes_per_step = int(plan.writes["nbytes"].sum())
        self.received_per_step = received_bytes(header, self.rank)
        self.step_records = o.step_records
        """Publish each step's record (`LoadOptions.step_records`)."""

    @staticmethod
    def load(path: str, rank: int, tensors: dict[str, torch.Tensor],
             options: LoadOptions | None = None, **fields: Any) -> Executor:
        """Load rank `rank` of a plan, bind `tensors`, register once and connect to the peers
        (`executor.load` is this function). `options` (`LoadOptions`), or its fields as
        keywords: the plan is refused unless signed with `plan_key`, and a plan rank whose
        coordinates (or its part's) differ from `identity` is refused (`IdentityError`,
        naming both) before registration; without an identity the load is refused unless
        `no_identity=True` (logged; `trust.py`)."""
        o = LoadOptions.of(options, fields)
        header, plan = load_rank(path, rank, None if o.plan_key is None else read_key(o.plan_key))
        return Executor.load_part(header, plan, tensors, o, path)

    @staticmethod
    def load_part(header: PlanHeader, plan: RankPlan, tensors: dict[str, torch.Tensor],
                  options: LoadOptions, path: str = "plan") -> Executor:
        """`load` of a rank's part its caller has read (`schemas.plan.read_rank`, under the
        header's signature where `options.plan_key` asked for one): identity first, then
        bind, register and connect."""
        check_identity(header, plan.identity, plan.rank, options.identity,
                       options.no_identity, path)  # first
        ex = Executor(header, plan, tensors, options)
        ex.register()
        ex.connect()
        return ex

    # ------------------------------------------------------------------ once

    def register(self) -> None:
        """Take the rank's lease, register the regions and publish them (once)."""
        if self.registered:
            return
        self.rejoined = self.control.claim(heartbeat=self.live_lease, live_check=self.live_lease)
        self.transport.register(self.regions)
        self.register_calls += 1
        self.exported = self.transport.export()
        self.control.publish_step(self.step + 1)
        self.control.publish_rank({"fingerprint": self.fingerprint,
                                   "sizes": [r.nbytes for r in self.plan.regions],
                                   "desc": self.exported,
                                   "digest": rank_digest(self.header, self.rank)})
        self.registered = True

    def connect(self) -> None:
        """Check and import every peer, then prepare every stage's ops (once)."""
        self.register()
        p = self.plan
        peers = sorted(set(p.writes["dst_rank"].tolist()) | set(p.signals["peer"].tolist())
                       | set(p.waits["peer"].tolist()))
        for peer in peers:
            rec, info = self.control.peer_info(peer)  # type: ignore[misc]
            self.import_peer(peer, rec, info)
        self.peers = peers
        self.recovery.connected(peers)
        if self.rejoined:  # a restarted rank joins at its peers' step (recovery.py)
            self.step = max(self.step, self.recovery.join_step() - 1)
            self.control.publish_step(self.step + 1)
        self._prepare()

    def _prepare(self) -> None:
        """Every stage's ops, prepared from the plan (at connect, and at a plan switch)."""
        p = self.plan
        self.overlap = Overlap(p)
        self.prepacked = self.overlap.prepacked.tolist()
        beside = beside_quants(p, self.prepacked)  # writes that run beside early QUANTs
        self.stages = [prepare_stage(p, s, self.regions, self.transport, groups(
            p, s, self.pack_groups, self.max_inflight), beside[s]) for s in range(p.stages)]
        link(p, self.stages)  # what each pack group waits for
        self.carries = carries(p).tolist()  # stage s may end with its writes in flight
        self.quiet = [self._quiet(s) for s in range(p.stages)]
        self.ready_first = bool(self.stages) and not self.quiet[0] and bool(self.stages[0].ready_to)
        self.signals.head(*self._head())

    def _head(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """What a step starts with, as the plan lists it: its first signal, where it is a READY
        (a stage's READYs go out first; a rank whose first signal is a DONE sends it after
        its writes are posted, off the path), and the READY/ACK waits of its first stage that
        waits, where they are that stage's first (`Signals.ahead` seals and expects them in
        the previous step's idle time; a wait for DONEs is idle time itself)."""
        sends: list[tuple[int, int, int]] | None = None
        waits: list[tuple[int, int, int]] | None = None
        for s, st in enumerate(self.stages):
            if sends is None and (st.ready_to or st.done_to):
                sends = [(st.ready_to[0], s, READY)] if st.ready_to else []
            if waits is None and (st.before or st.after):
                waits = list(st.before)  # none where it awaits DONEs first
            if sends is not None and waits is not None:
                break
        return sends or [], waits or []

    def _quiet(self, s: int) -> bool:
        """Whether this rank does nothing in stage `s` but await DONEs: no signal sent, no
        READY/ACK awaited, no pack, write or unpack, and stage s+1's packs not run early
        from it (a target between the stages it receives in, say)."""
        st, nxt = self.stages[s], s + 1
        return not (st.ready_to or st.before or st.packs or st.batches or st.pipeline
                    or st.done_to or st.unpacks or st.ack_to or st.slot_ack_to
                    or self.prepacked[s] or (nxt < len(self.stages) and self.prepacked[nxt]))

    def import_peer(self, peer: int, rec: Any, info: dict[str, Any]) -> None:
        """Check `peer`'s record and make it writable (at connect, and again on restart)."""
        self.check_peer(peer, info)
        self.control.accept_gen(peer, rec)
        check_peer_desc(self.transport, peer, info["desc"], self.plan.peer_regions)
        self.imported[peer] = info["desc"]
        try:
            self.transport.import_peer(peer, info["desc"])
        except Exception as e:  # e.g. NIXL cannot reach a dead process
            raise PeerLostError(self.rank, peer, "import its published descriptors", e) from e
        self.inbox.set_incarnation(peer, rec.inc, self.transport.peer_id(peer))

    def batches_to(self, peer: int) -> list[Prepared]:
        """Every prepared write batch to `peer` (re-prepared when it restarts)."""
        return [e for st in self.stages for e in st.batches if e.peer == peer]

    def check_peer(self, peer: int, info: dict[str, Any]) -> None:
        """Refuse `peer`'s published record unless it loaded this plan with the sizes this
        rank's plan expects (`PeerMismatchError`)."""
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

    def switch(self, path: str, plan_key: bytes | str | None = None,
               identity: dict | None = None, no_identity: bool = False,
               placement: Placement | None = None) -> None:
        """`switch_plan` to this rank's part of the plan file `path` (checked as `load`
        checks it: signature, identity)."""
        header, plan = load_rank(path, self.rank, None if plan_key is None else read_key(plan_key))
        check_identity(header, plan.identity, self.rank, identity, no_identity, path)
        self.switch_plan(header, plan, placement)

    def switch_plan(self, header: PlanHeader, plan: RankPlan,
                    placement: Placement | None = None) -> None:
        """Between steps: run `plan` (this rank's part of the same job's plan for another
        expert placement, e.g. `planner.replan`'s) from the next step on, keeping the bound
        tensors, their registration, the transport and the imported peers.

        Refused before anything changes (`PlanSwitchError`, one line) where the new part
        needs other regions or peers (load it then), and where `placement` (the engine's
        current one) is given and the plan was compiled for another. Every peer switches
        too: this rank publishes its record for the new plan and waits (up to `timeout_s`)
        for each peer's, checked as at connect (same plan, its own part's digest, the same
        region sizes and descriptors). Signals carry the plan's tag, so a peer still on the
        old plan never satisfies a wait of the new one."""
        self.check_switch(header, plan, placement)
        self.window.drain(self.timeout_s)  # nothing of the old plan's batches in flight
        if self.device.type == "cuda":
            device_sync(self.device)
        for st in self.stages:
            for entry in st.batches:
                self.transport.release(entry.handle)
        self.plan, self.header, self.fingerprint = plan, header, header.fingerprint
        self.tag = signals.fingerprint_tag(self.fingerprint)
        self.inbox.retag(self.tag)
        self.signals.retag(self.tag)
        self.bytes_per_step = int(plan.writes["nbytes"].sum())
        self.received_per_step = received_bytes(header, self.rank)
        self._prepare()
        self.switches += 1
        self.control.publish_rank({"fingerprint": self.fingerprint,
                                   "sizes": [r.nbytes for r in plan.regions],
                                   "desc": self.exported,  # not exported again: CUDA IPC
                                   # would hand out new handles, which peers refuse
                                   "digest": rank_digest(header, self.rank)})
        for peer in self.peers:
            self._await_switch(peer)

    def check_switch(self, header: PlanHeader, plan: RankPlan,
                     placement: Placement | None = None) -> None:
        """What `switch_plan` checks before anything changes (`PlanSwitchError`, one line;
        the part's own load checks raise theirs): callers that must agree with their peers
        before any of them switches (an engine's workers, the trainer ranks) ask it first."""
        if self.failed or not self.registered or self.overlap is None:
            raise PlanSwitchError(f"rank {self.rank}: switch plans between completed steps "
                                  "(after connect, not after a failed step: run it again "
                                  "first)")
        why = refusal(self.header, self.plan, header, plan, self.peers)
        if why is None and placement is not None and header.placement != placement:
            why = (f"rank {self.rank}: the new plan was compiled for placement "
                   f"{header.placement.digest()[:16] if header.placement else 'none'}, the "
                   f"engine holds {placement.digest()[:16]}; replan for the engine's "
                   "placement")
        if why is not None:
            raise PlanSwitchError(why)
        check_rank_plan(plan)
        check_rank_verify(plan, header)
        check_against_header(plan, header)

    def _await_switch(self, peer: int) -> None:
        """Wait for `peer`'s record of the plan this rank switched to, and check it."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            rec, info = self.control.peer_info(peer)  # type: ignore[misc]
            if info["fingerprint"] == self.fingerprint:
                break
            if time.monotonic() > deadline:
                raise PeerTimeoutError(self.rank, peer, "switch to the new plan "
                                       f"{self.fingerprint[:16]!r}", self.timeout_s)
            time.sleep(0.01)
        self.check_peer(peer, info)
        self.control.accept_gen(peer, rec)
        if info["desc"] != self.imported.get(peer):
            raise PeerMismatchError(f"rank {self.rank}: peer rank {peer} switched plans with "
                                    "other memory descriptors (it registered again or "
                                    "restarted); load the new plan on every rank", peer=peer)

    # ------------------------------------------------------------------ every step

    def run(self, step: int | None = None) -> RunStats:
        """One step: walk every stage; returns when this rank's part is done.

        Raises `PeerTimeoutError` (or a subclass; `.peer` is the rank to blame) when a peer
        is gone; `complete` is then False and the next `run()` recovers. `step`: the
        caller's step number (the same on every rank), or None to count steps here."""
        t0 = time.perf_counter()
        first = self.ready_first  # the step's first READYs go out before its running record
        self.begin_step(step, record=not first)
        try:
            if first:
                self.ready(0)
                self.record_running()
            s, n = 0, len(self.stages)
            while s < n:
                if self.quiet[s] and not len(self.window):
                    e = s + 1
                    while e < n and self.quiet[e]:
                        e += 1
                    self.await_quiet(s, e)
                    s = e
                    continue
                if s or not first:
                    self.ready(s)
                self.send_half(s)
                self.recv_half(s)
                s += 1
        except BaseException as e:
            self.fail(getattr(e, "peer", None))
            raise
        return self.end_step(t0)

    def begin_step(self, step: int | None = None, record: bool = True) -> None:
        """A step starts: recover first where the last failed, count it, and (`record`) hand
        its running record to the publisher (else the caller does, `record_running`)."""
        self.control.check()  # a newer process took this rank over: LeaseLostError
        self.complete = False
        if self.failed or self.inbox.foreign:
            self.step = self.recovery.recover(self.step, self.last_complete_step)
            self.failed = False
        self.step = self.step + 1 if step is None else step
        self.signals.begin(self.step)
        self.window.begin()
        if record:
            self.record_running()

    def record_running(self) -> None:
        """Hand the record of the step this rank is inside to the publisher thread (where
        peers join, recovery.py; it writes it `control.STEP_DELAY_S` later)."""
        if self.step_records:
            self.control.publish_step(self.step, running=True, later=True)

    def fail(self, lost: int | None = None) -> None:
        """Mark the step failed: tell every peer which rank was lost (its signals of this step
        are void; the others stop waiting for this one), publish the step so that a
        restarted peer can join."""
        self.failed, self.complete = True, False
        self.recovery.failed(self.window.abandon())  # settled before the next step posts
        if lost is not None:
            for peer in self.peers:  # best effort: their timeouts still hold
                best_effort(f"ABORT to rank {peer}", lambda p=peer: self.transport.notify(
                    p, self.signals.msg(p, lost, signals.ABORT)))
        # the store may be gone too; the timeout was raised
        best_effort("publishing the step", self.control.publish_step, self.step + 1)

    def end_step(self, t0: float) -> RunStats:
        self.signals.sync()  # unpacks are queued: the weights are whole after this
        self.complete = True
        self.last_complete_step = self.step
        seconds = time.perf_counter() - t0
        if self.step_records:  # where a restarted peer joins (recovery.py); the store may
            # be gone, and the weights are whole
            best_effort("publishing the step", self.control.publish_step, self.step + 1,
                        running=False, later=True)  # later: by the publisher thread
        waited = self.signals.waited + self.window.waited
        return RunStats(self.rank, self.step, self.bytes_per_step, self.received_per_step,
                        seconds, True, min(waited, seconds))

    def await_quiet(self, a: int, b: int) -> None:
        """Stages `a` to `b-1`, where this rank only awaits DONEs (`_quiet`) and has nothing
        in flight: what their `ready`, `send_half` and `recv_half` would do. Where every one
        of those DONEs is in already (a target's last stages, whose writes landed while it
        waited for an earlier stage's), they are taken at once; else the first stage's is
        awaited (with its own timeout, as `recv_half` does) and the rest looked at again."""
        waits = [w for s in range(a, b) for w in self.stages[s].after]
        for s in range(a, b):
            if not waits or self.signals.take_all(waits):
                return
            after = self.stages[s].after
            self.signals.wait(after, self.timeout_s)
            waits = waits[len(after):]

    def ready(self, s: int) -> None:
        """Step 1, first half: send this stage's READY signals."""
        self.signals.send(self.stages[s].ready_to, s, READY)

    def send_half(self, s: int, timeout_s: float | None = None) -> None:
        """Steps 1-4 of stage `s` after `ready`: wait READY/ACK, packs, writes, DONE.

        The packs of the next stage run here too, once the first writes are posted, where
        `schemas.protocol` allows it. When nothing arrives for this rank in stage `s`, its
        last writes may be in flight when the next stage starts (`window.py`; a grouped
        stage's packs wait only for those that read what they write): DONE when landed."""
        st = self.stages[s]
        timeout = self.timeout_s if timeout_s is None else timeout_s
        early = len(self.window) > 0  # writes of stage s-1 still in flight
        if early and not (self.signals.take(st.before)
                          and (self.prepacked[s] or not st.packs or st.pipeline)):
            self.window.drain(timeout)  # a wait, or packs that may touch their staging
            early = False
        self.signals.wait([] if early else st.before, timeout)
        nxt = s + 1 if s + 1 < len(self.stages) and self.prepacked[s + 1] else -1
        whole = not st.pipeline or self.prepacked[s]  # else group by group (`pipeline.py`)
        for g, (ops, entries) in enumerate(
                [([] if self.prepacked[s] else st.packs, st.batches)] if whole else st.pipeline):
            if not whole:
                self.window.drain_ids(st.blocked[g], timeout)
            if ops:
                for op in ops:
                    op()
                self.signals.mark_queued()
            if st.packs and not self.ordered_posts:
                self.signals.sync()  # writes read what the packs wrote: their kernels are done
            for i, entry in enumerate(entries):
                if i == self.max_inflight and nxt >= 0 and whole:
                    self._prepack(nxt, timeout)
                    nxt = -1
                self.window.post(entry, s, timeout)
                if self.one_stream:  # `local`: on the current stream
                    self.signals.mark_queued()
        if nxt >= 0:
            self._prepack(nxt, timeout)
        self.window.close(s)
        self.window.reap_landed()
        if not self.carries[s]:
            self.window.drain(timeout)  # the next stage starts with nothing in flight

    def _landed(self, s: int, handed: frozenset[int]) -> None:
        """Stage `s`'s writes have landed: DONE to the peers not handed to the device."""
        peers = self.stages[s].done_to
        self.signals.send([p for p in peers if p not in handed] if handed else peers, s, DONE)

    def _hand_off(self, s: int, entries: list[Prepared]) -> frozenset[int]:
        """Stage `s`'s writes are posted, `entries` still in flight: the peers whose DONE the
        transport sends from the device once those have landed (`notify_landed`)."""
        handles = [e.handle for e in entries]
        handed = set()
        for peer in self.stages[s].done_to:
            try:
                if self.transport.notify_landed(handles, peer, self.signals.msg(peer, s, DONE)):
                    handed.add(peer)
            except Exception as e:  # transports raise their own types
                raise PeerLostError(self.rank, peer, f"send DONE of stage {s}", e) from e
        return frozenset(handed)

    def _pack(self, s: int) -> None:
        for op in self.stages[s].packs:
            op()
        self.signals.mark_queued(bool(self.stages[s].packs))

    def _prepack(self, s: int, timeout_s: float) -> None:
        """Stage `s`'s packs, early: `schemas.protocol` made them safe against what stages
        s-1 and s-2 read; writes of older stages still in flight that read what they
        write land first."""
        assert self.overlap is not None
        for k in self.overlap.blockers(s, self.window.stages()):
            self.window.drain_stage(k, timeout_s)
        self._pack(s)

    def recv_half(self, s: int, timeout_s: float | None = None) -> None:
        """Steps 5-7 of stage `s`: wait DONE, unpacks, ACK."""
        st = self.stages[s]
        if st.after:  # (each call skipped where it has nothing to do: a step's path)
            self.signals.wait(st.after, self.timeout_s if timeout_s is None else timeout_s)
        if st.unpacks:
            for op in st.unpacks:
                op()
            self.signals.mark_queued()
            if not self.one_stream:
                self.signals.sync()  # ACK frees staging the unpacks read; the weights are whole
        if st.ack_to:
            self.signals.send(st.ack_to, s, ACK)
        if st.slot_ack_to:
            self.signals.send(st.slot_ack_to, s, SLOT_ACK)

    def close(self) -> None:
        self.control.close()
        try:
            if self.device.type == "cuda":  # nothing of this rank's may still run on the GPU
                device_sync(self.device)
            for st in self.stages:  # its CUDA graphs go now, not whenever the GC finds them
                for entry in st.batches:
                    self.transport.release(entry.handle)
        finally:
            self.stages = []
            self.transport.close()


load = Executor.load


def run(plan: Executor, step: int | None = None) -> RunStats:
    """One step of a loaded plan (`load`): source ranks push, target ranks receive."""
    return plan.run(step)
