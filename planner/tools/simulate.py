"""`rdma-plan simulate`: how long a plan takes on its topology, by a flow-level simulation.

The model (at batch granularity; a batch is one flow):
- Every rank walks its stages in the plan's protocol (`schemas.plan`): send READY, wait
  READY/ACK, packs, writes, DONE, wait DONE, unpacks, ACK. A signal arrives
  `write_overhead_us` after it is sent.
- A source posts its batches in plan order, as the executor does: up to `inflight`
  (`schemas.protocol.INFLIGHT` by default) batches posted and not yet landed (any landed
  batch frees its place); a batch goes over the source's NIC (`batches.nic` 0) or NVLink
  (`batches.nic` 1, same-host writes). A rank that receives nothing in a stage goes on to
  the next one when its last batches are posted (if that stage's waits have arrived and its
  packs ran early) and sends the DONE of the stage when they have landed, as the executor's
  window does (`executor/window.py`).
- A flow uses two resources: the egress and the ingress of its path: the source's and
  the target's NIC (`cluster.nic_gbps`, shared by all GPUs that NIC serves), or the
  source's and target's NVLink (`nvlink_gbps`, per GPU). Active flows share resources
  max-min fairly (progressive filling, exact up to `MAX_LEVELS` bottleneck levels),
  recomputed whenever the set of flows changes. The coarse model (`model`; plans over
  `EXACT_MAX_BATCHES` batches by default) lands the flows that end within a quantum of the
  first one together, when the group has moved its bytes in all (the rate-weighted mean of
  their ends): one rate computation per group; a flow lands at most a quantum early or late
  (`simgap`'s "coarse model" cause: the shares that idled less the bytes skipped).
- A batch's size is its bytes plus link time for its latency and its writes: once
  `write_overhead_us` (posting and completion: the writes of a batch are posted together
  and pipelined by the NIC, so the latency is paid per batch, not per write), plus
  `NIC_WRITE_S` per write on a NIC (each RDMA write costs the NIC a work request and
  headers; CX-7 class NICs process over 200 M messages/s) or `NVLINK_WRITE_S` per write
  over NVLink (between two GPUs `cuda_ipc` copies a batch with one kernel writing over
  NVLink; the constants' figures are in BENCHMARKS.md).
- Packs (and QUANTs) and unpacks of a stage run one after another on their rank: bytes
  (of the wider dtype side) at `pack_gbps`, plus `pack_overhead_us` per executor op (a
  QUANT, or a group of packs the executor runs as one vectorised op). A prepacked stage's
  packs (`schemas.protocol`) start when the previous stage posts its writes and overlap
  them (GPU copy kernels beside the NIC's DMA); the stage waits only for what is left.
- The transfer ends when the last rank finishes its last stage (the completion barrier).

`floor_s` is independent of the schedule: the most bytes through one NIC direction (or one
GPU's NVLink direction) over its bandwidth. The simulated time is never below it.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from planner.collector import gc_paused
from planner.tools.planfile import PlanFile, PlanRanks
from planner.tools.simflow import (
    NIC,
    Batches,
    SimRank,
    choose_quantum,
    concat_batches,
    initial_state,
    load_checked,
    nic_order,
    result,
)
from planner.tools.simgap import explain_gap
from planner.tools.simrates import RateCache
from planner.topology import NIC_WRITE_S, NVLINK_WRITE_S
from schemas.errors import PlanFormatError
from schemas.plan import ACK, DONE, READY, SLOT_ACK, Plan
from schemas.protocol import INFLIGHT

_WAIT_IN, _PACK, _WRITE, _SEND_DONE, _WAIT_DONE, _UNPACK, _SEND_ACK = range(7)


def simulate(path_or_plan: str | Plan, inflight: int = INFLIGHT,
             progress: Callable[[str], None] | None = None, model: str = "auto"
             ) -> dict[str, Any]:
    """Simulate a plan (a path or a `Plan`) on the cluster its header records.

    `inflight`: batches a rank keeps posted and not yet reaped (the executor's
    `max_inflight`); 1 sends one batch at a time. Any landed batch frees its place.
    `model`: "exact" (every landing is an event), "coarse" (landings within a quantum
    land together, `planner.tools.simflow.choose_quantum`), or "auto": exact up to
    `EXACT_MAX_BATCHES` batches, coarse above.

    Returns `estimated_s`, `floor_s`, `ratio`, `bottleneck`, per-NIC bytes and busy time
    (`nics`), NVLink totals, per-rank finish times, and `timeline`: numpy columns
    start, end, rank, chan (0 NIC, 1 NVLink), dst, bytes and lane (its slot in the
    rank's window) of every batch.
    """
    t_wall = time.perf_counter()
    src = PlanRanks(path_or_plan) if isinstance(path_or_plan, Plan) else \
        PlanFile(str(path_or_plan))
    with src, gc_paused():
        ranks = load_checked(src, progress)  # the blobs it reads, checked
        if progress is not None:
            progress("simulating")
        sim = _Sim(src, ranks, inflight)
        sim.quantum = choose_quantum(model, sim.size / np.minimum(sim.cap[sim.eres],
                                                                  sim.cap[sim.ires]))
        return sim.run(t_wall, progress)


class _Sim:
    """The simulation state; `run` drives it from t=0 to the last rank's finish. `src` is
    read again only for the two ranks the gap report names (`planner.tools.simgap`)."""

    def __init__(self, src: PlanRanks, ranks: list[SimRank],
                 inflight: int) -> None:
        header = src.header
        opts = header.options
        self.header, self.src = header, src
        self.inflight = max(1, inflight)
        self.world = len(ranks)
        self.lat = opts.write_overhead_us * 1e-6
        nic_names = sorted({r.nic for r in header.ranks}, key=nic_order)
        self.nic_names = nic_names
        nic_id = {n: i for i, n in enumerate(nic_names)}
        self.rank_nic = np.array([nic_id[r.nic] for r in header.ranks], dtype=np.int64)
        n_nic, w = len(nic_names), self.world
        self.nic_bps = header.cluster.nic_gbps * 1e9 / 8
        self.nv_bps = header.nvlink_gbps * 1e9 / 8
        # resources: NIC egress [0, n), NIC ingress [n, 2n), NVLink out [2n, 2n+w), in
        self.cap = np.concatenate([np.full(2 * n_nic, self.nic_bps), np.full(2 * w, self.nv_bps)])
        b = concat_batches({k: [getattr(sr.batches, k) for sr in ranks]
                            for k in Batches.__slots__})
        self.b = b
        nic = b.chan == NIC
        self.eres = np.where(nic, self.rank_nic[b.rank], 2 * n_nic + b.rank)
        self.ires = np.where(nic, n_nic + self.rank_nic[b.dst], 2 * n_nic + w + b.dst)
        bps = np.where(nic, self.nic_bps, self.nv_bps)
        per_write = np.where(nic, NIC_WRITE_S, NVLINK_WRITE_S)
        self.size = b.nbytes + (self.lat + b.writes * per_write) * bps
        # flows (`f_eres`, `f_ires`) number only the resources some batch uses (`ccap`)
        self.res_used, inv = np.unique(np.r_[self.eres, self.ires], return_inverse=True)
        self.ceres, self.cires, self.ccap = np.split(inv, 2) + [self.cap[self.res_used]]
        # queue (rank, stage) -> a slice of `qorder` (plan order within it)
        self.stages = [sr.stages for sr in ranks]
        smax = max(self.stages, default=1)
        key = b.rank * smax + b.stage
        self.qorder = np.argsort(key, kind="stable")
        bounds = np.searchsorted(key[self.qorder], np.arange(w * smax + 1))
        self.qbounds, self.smax = bounds.tolist(), smax
        self.pack_s = [sr.pack_s for sr in ranks]
        self.unpack_s = [sr.unpack_s for sr in ranks]
        self.overlap = [sr.overlap for sr in ranks]
        self.prepacked = [ov.prepacked.tolist() for ov in self.overlap]
        self.carries = [sr.carries for sr in ranks]  # as the executor's
        self.packs_end = [0.0] * self.world  # when a prepacked stage's packs finish
        self.packing: dict[tuple[int, int], tuple[float, float]] = {}  # (rank, stage) ->
        # when packs that did not run early ran
        self.sends = [sr.sends for sr in ranks]  # each stage's: kind -> peers
        # each stage's waits as signal keys (`SimRank.waits`): all of them (`_carry`), and
        # those of each of its two waiting phases
        self.waits = [sr.waits for sr in ranks]
        self.waits_in = [[[key for key in stage if key[2] != DONE] for stage in sr.waits]
                         for sr in ranks]
        self.waits_done = [[[key for key in stage if key[2] == DONE] for stage in sr.waits]
                           for sr in ranks]
        self.quantum = 0.0  # the exact model (`simulate` sets the model's)
        self.slack = np.zeros(len(self.cap))  # the coarse model's, by resource (`run`)

    # ------------------------------------------------------------ rank state machine

    def _advance(self, r: int, t: float) -> None:
        """Walk rank `r` from its current phase at time `t` until it must wait."""
        while True:
            s, ph = self.stage[r], self.phase[r]
            if s >= self.stages[r]:
                self.finish[r] = t
                return
            if ph in (_WAIT_IN, _WAIT_DONE):
                if ph == _WAIT_IN:
                    self._send(r, s, t, READY)
                self.phase[r] += 1
                if not self._wait(r, t, (self.waits_in if ph == _WAIT_IN
                                         else self.waits_done)[r][s]):
                    return
            elif ph in (_PACK, _UNPACK):
                dur = (self.pack_s if ph == _PACK else self.unpack_s)[r][s]
                if ph == _PACK and self.prepacked[r][s]:
                    dur = self.packs_end[r] - t  # started with stage s-1's writes
                elif ph == _PACK and dur > 0:
                    self.packing[(r, s)] = (t, t + dur)  # packs not run early (`simgap`)
                self.phase[r] += 1
                if dur > 0:
                    self._timer(t + dur, r)
                    return
            elif ph == _WRITE:
                self.phase[r] += 1
                if self._start_writes(r, s, t):
                    return
            elif ph in (_SEND_DONE, _SEND_ACK):
                self._send(r, s, t, DONE if ph == _SEND_DONE else ACK)
                if ph == _SEND_ACK:
                    self._send(r, s, t, SLOT_ACK)
                    self.stage[r], self.phase[r] = s + 1, _WAIT_IN
                else:
                    self.phase[r] += 1

    def _timer(self, at: float, r: int, post: bool = False) -> None:
        """Wake rank `r` at `at`: to walk on (`_advance`), or to post (`post`)."""
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, -1 - r if post else r))

    def _send(self, r: int, s: int, t: float, kind: int) -> None:
        peers = self.sends[r][s].get(kind)
        if not peers:
            return
        at = t + self.lat
        arrival, pop = self.arrival, self.waiters.pop
        wait_t, missing = self.wait_t, self.missing
        for peer in peers:
            key = (r, peer, kind, s)
            arrival[key] = at
            for waiter in pop(key, ()):
                if at > wait_t[waiter]:
                    wait_t[waiter] = at
                left = missing[waiter] - 1
                missing[waiter] = left
                if not left:
                    self._timer(wait_t[waiter], waiter)

    def _wait(self, r: int, t: float, keys: list[tuple[int, int, int, int]]) -> bool:
        """Register rank `r`'s waits `keys` (of one phase of a stage); True if it may go on
        at `t` at once."""
        latest, missing = t, 0
        get, waiters = self.arrival.get, self.waiters
        for key in keys:
            at = get(key)
            if at is None:
                waiters.setdefault(key, []).append(r)
                missing += 1
            elif at > latest:
                latest = at
        self.wait_t[r], self.missing[r] = latest, missing
        if missing == 0 and latest <= t:
            return True
        if missing == 0:
            self._timer(latest, r)
        return False

    def _start_writes(self, r: int, s: int, t: float) -> bool:
        """Post rank `r`'s first stage-`s` batches; True if it must wait for them. The
        next stage's packs start now if it is prepacked."""
        if s + 1 < self.stages[r] and self.prepacked[r][s + 1]:
            self.packs_end[r] = t + self.pack_s[r][s + 1]
        q = r * self.smax + s
        lo, hi = self.qbounds[q], self.qbounds[q + 1]
        if hi == lo:
            return False
        self.window[r] = [lo, lo, hi, 0]  # reaped up to, next to post, end, outstanding
        self.unlanded[r][s] = hi - lo
        self._post(r, t)
        return True

    def _carry(self, r: int, t: float) -> None:
        """Every batch of rank `r`'s stage is posted: go on to the next stage with them still
        in flight where the executor does (`schemas.protocol.carries`, and at run time: the
        next stage's READY/ACK waits have arrived and its packs, if any, were prepacked).
        The simulator carries only into a stage with writes (one with none has nothing to
        post: it walks on when these land). Its DONE goes out when they have landed."""
        s, win = self.stage[r], self.window[r]
        q = r * self.smax + s + 1
        if (not self.carries[r][s] or self.qbounds[q + 1] == self.qbounds[q]
                or (self.pack_s[r][s + 1] > 0 and not self.prepacked[r][s + 1])):
            return
        for key in self.waits[r][s + 1]:
            at = self.arrival.get(key)
            if at is None or at > t:
                return
        if self.unlanded[r][s]:
            self.deferred[r].add(s)
        else:
            self._send(r, s, t, DONE)
        self.unlanded[r][s + 1] = self.qbounds[q + 1] - self.qbounds[q]
        self.stage[r], self.phase[r] = s + 1, _SEND_DONE
        start = max(t, self.packs_end[r]) if self.prepacked[r][s + 1] else t
        if s + 2 < self.stages[r] and self.prepacked[r][s + 2]:
            inflight = [k for k, n in self.unlanded[r].items() if n]
            if self.overlap[r].blockers(s + 2, inflight):  # they must land first
                self.packs_after[r] = s + 2
                self.packs_end[r] = np.inf
            else:
                self.packs_end[r] = start + self.pack_s[r][s + 2]
        win[2] = self.qbounds[q + 1]
        self.hold[r] = start  # inf: until stage s-1's writes land (`_carried_landed`)
        if t < start < np.inf:
            self._timer(start, r, post=True)
        elif start <= t:
            self._post(r, t)

    def _post(self, r: int, t: float) -> None:
        """Post batches while fewer than `inflight` are posted and not yet reaped. (The
        flows' columns are set for all the batches posted at `t` at once: `_posted`.)"""
        win = self.window[r]
        if t < self.hold[r]:
            return  # the next stage's packs are still running
        posted = win[1] == win[2]
        n = min(win[2] - win[1], self.inflight - win[3])
        if n > 0:
            free, gid = self.free_slots[r], self.gid_l
            new = self.qorder_l[win[1]:win[1] + n]
            for g in new:
                slot = free.pop()
                gid[slot] = g
                self.new_slots.append(slot)
            self.new_gids += new
            win[1] += n
            win[3] += n
        self.dirty = True
        if win[1] == win[2] and not posted:
            self._carry(r, t)

    def _posted(self, t: float) -> None:
        """The batches posted at `t` (`_post`), as flows: their window slots' columns."""
        slots = np.array(self.new_slots, dtype=np.int64)
        g = self.gid[slots] = np.array(self.new_gids, dtype=np.int64)
        self.new_slots.clear()
        self.new_gids.clear()
        self.active[slots] = True
        self.rem[slots] = self.size[g]
        self.f_eres[slots], self.f_ires[slots] = self.ceres[g], self.cires[g]
        self.start[g], self.lane[g] = t, slots % self.inflight

    def _land(self, slots: np.ndarray, t: float) -> None:
        """The batches in window `slots` land at `t`, one after another: each frees its place
        and its rank posts its next batch, sends a carried stage's DONE, or walks on. (The
        per-batch lists bound once for the group.)"""
        g_all = self.gid[slots]
        self.end[g_all] = t
        self.active[slots] = False
        free, window, k = self.free_slots, self.window, self.inflight
        unlanded, deferred, stage, hold = self.unlanded, self.deferred, self.stage_l, self.hold
        qorder, gid, new_slots, new_gids = self.qorder_l, self.gid_l, self.new_slots, self.new_gids
        for slot, g in zip(slots.tolist(), g_all.tolist()):
            r = slot // k
            win = window[r]
            win[0] += 1  # any landed batch frees its place in the window
            s = stage[g]
            left = unlanded[r]
            left[s] -= 1
            if not left[s] and s in deferred[r]:
                win[3] -= 1
                free[r].append(slot)
                self._carried_landed(r, s, t)
            elif win[3] == k and win[1] + 1 < win[2] and hold[r] <= t:
                # a full window with more than one batch to post: the next batch takes
                # this place (what `_post` does here, inline: the common case)
                g = qorder[win[1]]
                gid[slot] = g
                new_slots.append(slot)
                new_gids.append(g)
                win[1] += 1
                continue
            else:
                win[3] -= 1
                free[r].append(slot)
            if win[0] == win[2]:
                self._advance(r, t)
            else:
                self._post(r, t)
        self.landed += len(slots)
        self.dirty = True

    def _carried_landed(self, r: int, s: int, t: float) -> None:
        """Rank `r`'s carried stage `s` has landed: its DONE goes out, and early packs that
        waited for its writes start."""
        self.deferred[r].discard(s)
        self._send(r, s, t, DONE)
        k = self.packs_after[r]  # early packs of stage k wait for older writes
        if k >= 0 and not self.overlap[r].blockers(
                k, [j for j, n in self.unlanded[r].items() if n]):
            self.packs_after[r] = -1
            self.packs_end[r] = t + self.pack_s[r][k]
            if self.hold[r] == np.inf:
                self.hold[r] = self.packs_end[r]
                self._timer(self.hold[r], r, post=True)

    # ------------------------------------------------------------ the event loop

    def run(self, t_wall: float, progress: Callable[[str], None] | None = None
            ) -> dict[str, Any]:
        initial_state(self)
        self.rates = RateCache(len(self.ccap))  # (tests replace it by a reference)
        # what the per-batch steps read one value at a time, as lists (a numpy scalar read
        # costs several times a list's; the values are the same)
        self.qorder_l, self.stage_l = self.qorder.tolist(), self.b.stage.tolist()
        self.gid_l = self.gid.tolist()  # each window slot's batch (`gid` once posted)
        self.new_slots: list[int] = []  # slots posted since the flows were last set
        self.new_gids: list[int] = []  # and their batches
        w, nb = self.world, len(self.b.rank)
        busy, slack = np.zeros(len(self.ccap)), np.zeros(len(self.ccap))
        t, events = 0.0, 0
        step = max(1, nb // 10)
        report = step if progress is not None else nb + 1
        for r in range(w):
            self._advance(r, 0.0)
        act, r_act, rem = np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
        a_e = a_i = act  # the active flows' egress and ingress
        while True:  # the active flows' slots, rates and bytes left change only when dirty
            if self.dirty:
                if self.new_slots:
                    self._posted(t)
                act = np.flatnonzero(self.active)
                a_e, a_i = self.f_eres[act], self.f_ires[act]
                r_act = self.rates.rates(a_e, a_i, self.ccap) if len(act) else np.zeros(0)
                rem = self.rem[act]
                used = np.zeros(len(self.ccap), dtype=bool)  # resources some flow uses
                used[a_e] = used[a_i] = True
                self.dirty = False
            t_timer = self.heap[0][0] if self.heap else np.inf
            ttf = rem / r_act
            dt_flow = ttf.min() if len(act) else np.inf
            if t_timer == np.inf and dt_flow == np.inf:
                break
            events += 1
            if t_timer - t <= dt_flow:
                dt = max(t_timer - t, 0.0)
                done = act[:0]
            else:  # exact: flows ending within a hair of the first end land together (never
                # earlier); coarse: also those within `quantum` of it (before any timer)
                near = ttf <= max(dt_flow * (1 + 1e-9) + 1e-12,
                                  min(dt_flow + self.quantum, t_timer - t))
                done, t_near = act[near], ttf[near]
                dt = t_near.max()
                if self.quantum:  # the group lands when it has moved its bytes in all; the
                    # early ones' shares idled until then, the late ones' last bytes are
                    # skipped: the model's slack (signed)
                    r_near = r_act[near]
                    dt = min(max(rem[near].sum() / r_near.sum(), dt_flow), dt)
                    idle = (dt - t_near) * r_near
                    slack += (np.bincount(a_e[near], idle, len(slack))
                              + np.bincount(a_i[near], idle, len(slack)))
            if len(act) and dt > 0:
                rem -= r_act * dt
                self.rem[act] = rem
                np.add(busy, dt, out=busy, where=used)
            t += dt
            if len(done):
                self._land(done, t)
            if self.landed >= report:
                report += step
                progress(f"simulating: {self.landed:,}/{nb:,} batches landed, "  # type: ignore[misc]
                         f"at {t * 1e3:.1f} ms simulated")
            while self.heap and self.heap[0][0] <= t:
                _, _, r = heapq.heappop(self.heap)
                if r < 0:
                    self._post(-1 - r, t)
                else:
                    self._advance(r, t)
        stuck = [r for r in range(w) if self.stage[r] < self.stages[r]]
        if stuck:
            raise PlanFormatError(f"simulate: ranks {stuck[:8]} never finish (a wait that no rank "
                             "signals); the plan is inconsistent: run `rdma-plan verify`")
        busy = np.bincount(self.res_used, busy, len(self.cap))  # by resource index again
        self.slack = np.bincount(self.res_used, slack, len(self.cap))  # bytes
        res = result(self, busy, events, time.perf_counter() - t_wall)
        res["gap"] = explain_gap(self, res)
        return res
