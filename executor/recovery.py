"""What the next `run()` does after a failed one (docs/reliability.md, recovery protocol).

1. Incarnations. Every `Executor` draws a random 64-bit incarnation id, sealed into its
   records (`control.py`) and carried by every signal; a signal counts only if its
   incarnation is the one this rank imported for the sender (`signals.py`).
2. Re-import. A rank restarted after a crash loads the plan again: it takes the rank's lease
   once the old process is gone, registers, publishes its new descriptors (a newer
   generation) and connects. A surviving rank, at the start of the `run()` after a failed
   one (or as soon as it sees a signal of an unknown incarnation), reads every peer's record;
   for a peer whose incarnation changed it checks the record (MAC, generation, fingerprint,
   sizes), re-imports the descriptors and re-prepares the write batches to that peer (the
   old ones are released). A record that fails the checks is refused with a warning and the
   old import kept: garbage in the store never breaks recovery.
3. In-flight writes. Batches still in flight when a step failed are waited for (briefly)
   and, if not finished, released and prepared again before anything is re-posted.
4. Steps. Signals carry the step number; a rank publishes the step it runs next
   (`<ns>/step/<r>`) when it registers and when a step ends or fails, and the step it is
   inside when one begins (flagged `running`). A survivor recovering runs the largest of
   the published steps and its last completed step + 1; a restarted rank runs the largest
   published step, or the one after it where that peer is inside it: such a step waits for
   the dead process (its READYs went there) and ends, failed or not, without the newcomer
   (found by `test_source_killed_mid_update`: joined at the step its targets were stuck in,
   the new source waited for READYs that never came while they moved on). So the next
   `run()` has the same number everywhere. (A rank
   that failed a step no peer started runs the same number again: its `ABORT` voided the
   signals it sent in the failed attempt. A caller that knows its training step can pass
   `run(step=n)` on every rank instead.)
Re-import needs a transport whose `import_peer` can be called again for a new process:
`nixl` and `local` (not yet `uccl`, `cuda_ipc`: their mailboxes count messages per pair).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .cleanup import best_effort
from .errors import ForgedRecordError, PeerMismatchError

if TYPE_CHECKING:
    from .control import Control
    from .signals import Inbox
    from .transports.base import Prepared, Transport

log = logging.getLogger("executor")


class Recovery:
    """The executor's part that recovers after a failed step (steps 2-4 of the module doc).
    It owns the batches in flight when a step failed (`pending`) and what recovery did
    (`reimports`, `reprepared`); it reads the executor's peers' records through `control`,
    checks one with `check_peer`, imports it with `import_peer`, and finds the prepared
    batches to a peer with `batches_to`."""

    def __init__(self, rank: int, control: Control, transport: Transport, inbox: Inbox,
                 timeout_s: float, check_peer: Callable[[int, dict], None],
                 import_peer: Callable[[int, Any, dict], None],
                 batches_to: Callable[[int], list[Prepared]]) -> None:
        self.rank, self.control, self.transport, self.inbox = rank, control, transport, inbox
        self.timeout_s = timeout_s
        self.check_peer, self.import_peer, self.batches_to = check_peer, import_peer, batches_to
        self.peers: list[int] = []
        self.pending: list[Prepared] = []
        """Batches in flight when a step failed (settled before the next step posts)."""
        self.reimports = 0
        """Peers re-imported after they restarted."""
        self.reprepared = 0
        """Batches released and prepared again after a failed step."""

    def connected(self, peers: list[int]) -> None:
        """The peers imported at connect (those whose records recovery reads)."""
        self.peers = list(peers)

    def failed(self, in_flight: list[Prepared]) -> None:
        """A step failed with `in_flight` batches still posted: settle them before the next."""
        self.pending += in_flight

    def recover(self, step: int, last_complete_step: int) -> int:
        """Before a step that follows a failure: settle the batches in flight, re-import
        restarted peers, and the step number to continue from (a failed step is run again
        only if no peer has started it; `step` when the store cannot say)."""
        self.settle_pending()
        self.refresh_peers()
        nxt = best_effort("reading the peers' next step", self.peers_next_step)
        return step if nxt is None else max(last_complete_step, nxt - 1)

    def peers_next_step(self) -> int:
        """The largest step the peers run next or are inside now, per the store (0 if none
        published): where a survivor, imported by its peers, can take part."""
        steps = [self.control.peer_step(peer) for peer in self.peers]
        return max([0, *(s[0] for s in steps if s is not None)])

    def join_step(self) -> int:
        """Where a restarted rank joins: the largest step its peers run next, past any step a
        peer is inside now (that step waits for the dead process, to which its READYs went,
        and ends, failed or not, without this one)."""
        steps = [self.control.peer_step(peer) for peer in self.peers]
        return max([0, *(s[0] + s[1] for s in steps if s is not None)])

    def settle_pending(self) -> None:
        """Batches in flight when a step failed: done, or released and prepared again."""
        deadline = time.monotonic() + min(self.timeout_s, 1.0)
        for entry in self.pending:
            while True:  # a batch whose `done` raises failed: prepare it again
                done = best_effort(f"polling a batch to rank {entry.peer} left in flight",
                                   self.transport.done, entry.handle)
                if done:
                    break
                if done is None or time.monotonic() >= deadline:
                    self.reprepared += 1
                    self.transport.release(entry.handle)
                    entry.handle = self.transport.prepare(entry.batch)
                    break
                time.sleep(1e-3)
        self.pending = []

    def refresh_peers(self) -> None:
        """Re-import every peer whose published incarnation changed (it restarted)."""
        for peer in self.peers:
            try:
                got = self.control.peer_info(peer, wait=False)
            except ForgedRecordError as e:
                log.warning("rank %d: %s; keeping the imported peer", self.rank, e)
                continue
            except Exception as e:  # noqa: BLE001 - the store may be gone: nothing to re-import
                log.info("rank %d: reading rank %d's record failed, no peer re-imported: "
                         "%s: %s", self.rank, peer, type(e).__name__, e)
                return
            if got is None or got[0].inc == self.inbox.incarnations.get(peer):
                continue
            rec, info = got
            try:
                self.check_peer(peer, info)
                self.control.accept_gen(peer, rec)
            except (ForgedRecordError, PeerMismatchError) as e:
                log.warning("rank %d: %s; keeping the imported peer", self.rank, e)
                continue
            self._reimport(peer, rec, info)
        self.inbox.clear_foreign()

    def _reimport(self, peer: int, rec: object, info: dict) -> None:
        entries = self.batches_to(peer)
        for e in entries:
            self.transport.release(e.handle)
            e.handle = None
        self.import_peer(peer, rec, info)
        for e in entries:
            e.handle = self.transport.prepare(e.batch)
        self.reimports += 1
