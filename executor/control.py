"""The control plane of one rank: its sealed records in the rendezvous store and its lease.

Records (all sealed by `auth.seal`, read only through `auth.open_record` and the checks
here, so garbage or a forgery gives `ForgedRecordError` naming the key, never a decoding
traceback):

- `<ns>/rank/<r>`: the rank's descriptors (fingerprint, region sizes, the transport's
  `export()`), encrypted under the job secret;
- `<ns>/step/<r>`: the step the rank runs next (an int in [0, 2^62)), taken only from the
  process that holds the rank's lease (a dead process's record replayed is ignored); within a step's
  path a publisher thread writes it (`publish_step(later=True)`: no store round trip on
  the step's critical path), `STEP_DELAY_S` after it is asked to, the newest record
  then pending (its Python work, sealing, takes the GIL from the step, a visible share of
  a sub-millisecond step); while steps follow one another it naps `STEP_DELAY_S` between
  writes and a publish only leaves its record (waking a waiting thread costs the step a
  futex call and the GIL handed over and back), and only a publish that finds it idle
  wakes it; elsewhere the caller does;
- `<ns>/lease/<r>`: the lease: the holding process's incarnation, its generation (one more
  than the process it replaced), a heartbeat counter and the wall-clock time of the beat
  (`at`), all under the MAC.
- `<ns>/beat/<token>/<r>`: the same beat again, under a key of a random token the process
  draws at start and names only inside its encrypted `rank` record: a stray without the
  secret cannot know the key, so it cannot replay old records over it. Readers that hold
  the secret take a rank's newest of the two (`alive_record`): a live rank whose lease key
  a stray keeps overwriting with replays still shows fresh beats.

Freshness: a lease record is evidence of life only if it was sealed after the reader began
to watch (`fresh`: its `at` is later than the reader's clock then, less `SKEW_S`). A stray
that read the store cannot make such a record (the MAC covers `at`); replaying the records
of a dead process, in any order, shows times from before it died, so it can neither block
the restart of that rank (`claim`) nor make survivors blame another rank (`blame.py`). The
job's hosts' clocks must agree within `SKEW_S` (NTP keeps them within milliseconds).

One rank, one process. `claim()` reads the lease: if none (or garbage) the rank is free; if
its heartbeat moves during `LEASE_S`, a live process holds the rank and `LeaseHeldError`
names it; if not, the old process is gone and this one takes over with the next generation.
A heartbeat thread then renews the lease every `BEAT_S`, rewrites this rank's records if
anything overwrote them, and notices when a newer process took the rank over (`check()`
then raises `LeaseLostError` at the next step). Peers' records carry the generation: a record
of an older generation than the one imported (a replay of a dead process's record) is
refused.

Store calls are serialised by a lock (the heartbeat thread shares the store). The store must
answer `get` of a missing key at once with None (`rendezvous.open_store` wraps stores whose
`get` blocks, like torch's, through their `check`).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

from .auth import Keys, Record, open_record, seal
from .cleanup import best_effort
from .errors import ForgedRecordError, LeaseHeldError, LeaseLostError, PeerTimeoutError
from .transports.base import Store

log = logging.getLogger("executor")
BEAT_S = 0.25
STEP_DELAY_S = 2e-3
"""How long the publisher lets a step record wait for a newer one (a restarted peer
takes seconds to come up; records of fast steps coalesce)."""
LEASE_S = 1.5
"""A lease whose heartbeat does not move for this long is taken over."""
SKEW_S = 0.25
"""How far the job's hosts' clocks may disagree: a lease sealed this long before a reader
began to watch still counts as fresh."""
MAX_STEP = 1 << 62
MAX_REGIONS = 1 << 16


class Control:
    def __init__(self, store: Store, keys: Keys, namespace: str, rank: int, inc: int,
                 timeout_s: float) -> None:
        self.store, self.keys, self.ns, self.rank, self.inc = store, keys, namespace, rank, inc
        self.timeout_s = timeout_s
        self.gen = 0
        self.lock = threading.Lock()
        self.mine: dict[str, bytes] = {}
        """Records this process wrote (key -> value): kept there by the heartbeat."""
        self.peer_gens: dict[int, int] = {}
        self.lost: str = ""
        self.beat = 0
        self.republished = 0
        self.refused = 0  # peers' records refused (garbage, forged, replayed)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.step_lock = threading.RLock()
        """The lock of `step_cv`, taken directly where a step's path only sets a record (no
        Python frames of `Condition.__enter__`)."""
        self.step_cv = threading.Condition(self.step_lock)
        self.step_order = threading.Lock()  # step records reach the store in program order
        self.step_pending: tuple[int, bool, int] | None = None  # (step, running, epoch)
        self.step_epoch = 0  # bumped by every synchronous publish: older pendings are void
        self.step_thread: threading.Thread | None = None
        self.step_idle = True
        """The publisher waits for a record with nothing pending (a publish must wake it)."""
        self.token = os.urandom(8).hex()
        """This process's beat key token (named only in its encrypted rank record)."""
        self.tokens: dict[int, tuple[int, str]] = {}
        """Peer -> (generation, beat token) of the newest rank record read of it."""

    def key(self, kind: str, rank: int) -> str:
        return f"{self.ns}/{kind}/{rank}"

    def get(self, key: str) -> bytes | None:
        with self.lock:
            return self.store.get(key)

    def _put(self, key: str, body: Any, step: int = 0, encrypt: bool = False) -> None:
        value = seal(self.keys, key, self.rank, self.inc, self.gen, step, body, encrypt)
        with self.lock:
            self.store.set(key, value)
            self.mine[key] = value

    # ------------------------------------------------------------------ lease

    def claim(self, heartbeat: bool = True, live_check: bool = True) -> bool:
        """Take this rank's lease; True if an earlier process held the rank. `live_check`:
        refuse if the holder's heartbeat moves (off where one process holds every rank)."""
        key = self.key("lease", self.rank)
        old = self._read(key, self.rank)
        if old is not None and live_check:
            self._wait_gone(key, old)
        self.gen = old.gen + 1 if old is not None else 1
        self._put(key, {"beat": 0, "at": time.time()})
        self._put(self.key(f"beat/{self.token}", self.rank), {"beat": 0, "at": time.time()})
        if heartbeat:
            # stop beating before the interpreter (or the store rank 0 hosts) is torn down
            atexit.register(self.close)
            self.thread = threading.Thread(target=self._heartbeat, daemon=True,
                                           name=f"rplan-lease-{self.rank}")
            self.thread.start()
        return old is not None

    def _read(self, key: str, rank: int) -> Record | None:
        raw = self.get(key)
        if raw is None:
            return None
        try:
            return open_record(self.keys, key, raw, rank, encrypted=False)
        except ForgedRecordError as e:
            self.refused += 1
            if self.refused <= 16:
                log.warning("%s (ignored)", e)
            return None

    def lease(self, rank: int) -> Record | None:
        """Rank `rank`'s lease record, or None (absent, or refused with a warning)."""
        return self._read(self.key("lease", rank), rank)

    def alive_record(self, rank: int) -> Record | None:
        """Rank `rank`'s newest beat: its lease record or its beat under the token of its
        rank record (the newest generation read), whichever was sealed later; None if
        neither is there (or valid)."""
        if rank not in self.tokens or self.tokens[rank][0] < self.gen_of(rank):
            # reads the token (peer_info caches it); a refused record leaves the one cached
            best_effort(f"reading rank {rank}'s record", self.peer_info, rank, False)
        recs = [self.lease(rank)]
        if rank in self.tokens:
            recs.append(self._read(self.key(f"beat/{self.tokens[rank][1]}", rank), rank))
        return max((r for r in recs if r is not None), key=lambda r: lease_time(r) or 0.0,
                   default=None)

    def gen_of(self, rank: int) -> int:
        """The generation of rank `rank`'s lease record now (0: none)."""
        rec = self.lease(rank)
        return 0 if rec is None else rec.gen

    def _wait_gone(self, key: str, old: Record) -> None:
        """Raise `LeaseHeldError` if a new lease record sealed after this call began (less
        `SKEW_S`) shows up within `LEASE_S`: its holder beats. Records sealed before (a
        replay) are no evidence, however often they change."""
        since, first = time.time(), self.get(key)
        deadline = time.monotonic() + LEASE_S
        while time.monotonic() < deadline:
            time.sleep(BEAT_S / 2)
            raw = self.get(key)
            cur = None if raw == first else self._read(key, self.rank)
            if cur is not None and fresh(cur, since):  # a new record, and a recent one
                raise LeaseHeldError(
                    f"rank {self.rank} is held by a live process (incarnation {cur.inc:#x}, "
                    f"generation {cur.gen}): one rank, one process; stop that process (or "
                    "wait until it is gone) before starting another for this rank")

    def _heartbeat(self) -> None:
        while not self.stop.wait(BEAT_S):
            try:
                if not self._heartbeat_once():
                    return
            except Exception as e:  # noqa: BLE001 - the store may be down; keep trying
                log.debug("rank %d: heartbeat failed: %s", self.rank, e)

    def _heartbeat_once(self) -> bool:
        """Renew the lease and heal this rank's records; False if the lease was lost."""
        key = self.key("lease", self.rank)
        cur = self._read(key, self.rank)
        if cur is not None and (cur.inc, cur.gen) != (self.inc, self.gen) \
                and cur.gen >= self.gen:
            self.lost = (f"rank {self.rank}: process {self.inc:#x} lost its lease to "
                         f"process {cur.inc:#x} (generation {cur.gen}); this process "
                         "must stop (one rank, one process)")
            log.error(self.lost)
            return False
        self.beat += 1
        self._put(key, {"beat": self.beat, "at": time.time()})
        self._put(self.key(f"beat/{self.token}", self.rank), {"beat": self.beat,
                                                              "at": time.time()})
        self._heal()
        return True

    def _heal(self) -> None:
        """Rewrite this rank's records that something else overwrote."""
        with self.lock:  # the main thread may publish meanwhile: compare what is current
            for key, value in self.mine.items():
                if self.store.get(key) != value:
                    self.store.set(key, value)
                    self.republished += 1
                    if self.republished <= 16:
                        log.warning("rank %d: store record %r was overwritten; rewritten",
                                    self.rank, key)

    def check(self) -> None:
        if self.lost:
            raise LeaseLostError(self.lost)

    def close(self) -> None:
        self.stop.set()
        with self.step_cv:
            self.step_cv.notify()
        if self.step_thread is not None:  # it writes what is pending, then returns
            self.step_thread.join(timeout=2 * BEAT_S + 1)
        if self.thread is not None:
            self.thread.join(timeout=2 * BEAT_S + 1)

    # ------------------------------------------------------------------ records

    def publish_rank(self, info: dict[str, Any]) -> None:
        self._put(self.key("rank", self.rank), dict(info, beat=self.token), encrypt=True)

    def publish_step(self, step: int, running: bool = False, later: bool = False) -> None:
        """Publish where a restarted peer joins: `step` is the next step this rank runs, or
        (`running`) the step it is inside now (recovery.py, rule 4). `later`: hand it to
        the publisher thread (a store round trip off the step's path; a newer publish
        replaces one not written yet, and a synchronous one voids it)."""
        if later and self.thread is not None and not self.stop.is_set():
            with self.step_lock:  # wake the publisher only if it is idle: a wake-up costs
                self.step_pending = (int(step), bool(running), self.step_epoch)  # the step
                if self.step_idle:  # a futex call and the GIL handed over and back
                    self.step_cv.notify()
            if self.step_thread is None:
                self.step_thread = threading.Thread(target=self._publisher, daemon=True,
                                                    name=f"rplan-step-{self.rank}")
                self.step_thread.start()
            return
        with self.step_order:
            with self.step_cv:
                self.step_pending, self.step_epoch = None, self.step_epoch + 1
            self._put_step(int(step), bool(running))

    def _put_step(self, step: int, running: bool) -> None:
        self._put(self.key("step", self.rank), {"next": step, "running": running}, step=step)

    def _publisher(self) -> None:
        while True:
            with self.step_cv:
                if self.step_pending is None and not self.stop.is_set():
                    # a nap no publish ends: while steps follow one another, each publish
                    # only leaves its record here for the next write
                    self.step_cv.wait_for(self.stop.is_set, STEP_DELAY_S)
                while self.step_pending is None and not self.stop.is_set():
                    self.step_idle = True  # idle: the next publish wakes this thread
                    self.step_cv.wait(BEAT_S)
                woken, self.step_idle = self.step_idle, False
                if woken and not self.stop.is_set():  # newer records of fast steps replace
                    self.step_cv.wait_for(self.stop.is_set, STEP_DELAY_S)  # this one
                got, self.step_pending = self.step_pending, None
            if got is None:
                if self.stop.is_set():
                    return  # stopped with nothing left to write
                continue  # a synchronous publish voided it while it waited
            with self.step_order:
                if got[2] == self.step_epoch:  # else a synchronous publish came after it
                    try:
                        self._put_step(got[0], got[1])
                    except Exception as e:  # noqa: BLE001 - the store may be gone
                        log.debug("rank %d: step record not published: %s", self.rank, e)

    def peer_step(self, peer: int) -> tuple[int, bool] | None:
        """(the step `peer` runs next or is inside now, whether it is inside it), or None
        (absent, or refused with a warning)."""
        key = self.key("step", peer)
        rec = self._read(key, peer)
        if rec is None:
            return None
        lease = self._read(self.key("lease", peer), peer)
        if lease is not None and (rec.inc, rec.gen) != (lease.inc, lease.gen):
            log.warning("store record %r: written by process %#x (generation %d), not by the "
                        "rank's lease holder %#x (generation %d): a replay of another "
                        "process's record (ignored)", key, rec.inc, rec.gen, lease.inc, lease.gen)
            return None
        body = rec.body if isinstance(rec.body, dict) else {}
        nxt, running = body.get("next"), body.get("running", False)
        if type(nxt) is not int or not 0 <= nxt < MAX_STEP or nxt != rec.step \
                or type(running) is not bool:
            log.warning("store record %r: step %r (running %r) is not an int in [0, 2^62) "
                        "and a bool (ignored)", key, nxt, running)
            return None
        return nxt, running

    def peer_info(self, peer: int, wait: bool = True) -> tuple[Record, dict[str, Any]] | None:
        """`peer`'s checked descriptor record (waiting up to `timeout_s` if `wait`).

        A refused record (garbage or a forgery over the peer's own) is waited out: the peer's
        heartbeat rewrites its record; `ForgedRecordError` only if none is valid in time."""
        key = self.key("rank", peer)
        deadline = time.monotonic() + self.timeout_s
        while True:
            raw = self.get(key)
            if raw is not None:
                try:
                    rec = open_record(self.keys, key, raw, peer)
                    info = _check_info(key, rec)
                    tok = info.get("beat")
                    if isinstance(tok, str) and len(tok) == 16 and \
                            rec.gen >= self.tokens.get(peer, (0, ""))[0]:
                        self.tokens[peer] = (rec.gen, tok)
                    return rec, info
                except ForgedRecordError as e:
                    self.refused += 1
                    if not wait or time.monotonic() > deadline:
                        raise
                    if self.refused <= 16:
                        log.warning("rank %d: %s; waiting for rank %d's own record", self.rank,
                                    e, peer)
            elif not wait:
                return None
            if time.monotonic() > deadline:
                raise PeerTimeoutError(self.rank, peer, "publish its regions (load the plan)",
                                       self.timeout_s)
            time.sleep(0.01)

    def accept_gen(self, peer: int, rec: Record) -> None:
        """Refuse a record older than the one imported for `peer` (a replay)."""
        have = self.peer_gens.get(peer, 0)
        if rec.gen < have:
            self.refused += 1
            raise ForgedRecordError(
                f"store record {self.key('rank', peer)!r}: generation {rec.gen} is older than "
                f"the imported {have}: a replay of a dead process's record (refused)",
                key=self.key("rank", peer))
        self.peer_gens[peer] = rec.gen


def lease_time(rec: Record) -> float | None:
    """When the lease record was sealed (its `at`), or None where it has no valid one."""
    at = rec.body.get("at") if isinstance(rec.body, dict) else None
    return float(at) if type(at) in (int, float) and at == at else None


def fresh(rec: Record, since: float) -> bool:
    """Whether the lease record was sealed after wall-clock time `since` (less `SKEW_S`)."""
    at = lease_time(rec)
    return at is not None and at > since - SKEW_S


def _check_info(key: str, rec: Record) -> dict[str, Any]:
    """The descriptor body's fields, typed and in range."""
    info = rec.body

    def bad(why: str) -> ForgedRecordError:
        return ForgedRecordError(f"store record {key!r}: {why} (refused)", key=key)

    if not isinstance(info, dict):
        raise bad(f"body is a {type(info).__name__}, not a map")
    fp, sizes, desc = info.get("fingerprint"), info.get("sizes"), info.get("desc")
    if not isinstance(fp, str) or len(fp) > 256:
        raise bad("'fingerprint' is not a string of <= 256 characters")
    if not isinstance(sizes, list) or len(sizes) > MAX_REGIONS or not all(
            type(n) is int and 0 <= n < 1 << 48 for n in sizes):
        raise bad(f"'sizes' is not a list of <= {MAX_REGIONS} byte counts")
    if not isinstance(desc, dict):
        raise bad("'desc' (the transport's descriptors) is not a map")
    return info
