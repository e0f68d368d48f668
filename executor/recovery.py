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
from typing import TYPE_CHECKING

from .cleanup import best_effort
from .errors import ForgedRecordError, PeerMismatchError

if TYPE_CHECKING:
    from .core import Executor
    from .transports.base import Prepared

log = logging.getLogger("executor")


def recover(ex: Executor) -> None:
    """Before a step that follows a failure (steps 2-4 of the module doc)."""
    settle_pending(ex)
    refresh_peers(ex)
    # a failed step is run again only if no peer has started it; the store may be gone:
    # then keep our own count
    nxt = best_effort("reading the peers' next step", peers_next_step, ex)
    if nxt is not None:
        ex.step = max(ex.last_complete_step, nxt - 1)
    ex.failed = False


def peers_next_step(ex: Executor) -> int:
    """The largest step the peers run next or are inside now, per the store (0 if none
    published): where a survivor, imported by its peers, can take part."""
    steps = [ex.control.peer_step(peer) for peer in ex.peers]
    return max([0, *(s[0] for s in steps if s is not None)])


def join_step(ex: Executor) -> int:
    """Where a restarted rank joins: the largest step its peers run next, past any step a
    peer is inside now (that step waits for the dead process, to which its READYs went, and
    ends, failed or not, without this one)."""
    steps = [ex.control.peer_step(peer) for peer in ex.peers]
    return max([0, *(s[0] + s[1] for s in steps if s is not None)])


def settle_pending(ex: Executor) -> None:
    """Batches in flight when a step failed: done, or released and prepared again."""
    deadline = time.monotonic() + min(ex.timeout_s, 1.0)
    for entry in ex.pending:
        while True:
            try:
                if ex.transport.done(entry.handle):
                    break
                failed = False
            except Exception:  # noqa: BLE001 - a failed batch: prepare it again
                failed = True
            if failed or time.monotonic() >= deadline:
                ex.reprepared += 1
                ex.transport.release(entry.handle)
                entry.handle = ex.transport.prepare(entry.batch)
                break
            time.sleep(1e-3)
    ex.pending = []


def refresh_peers(ex: Executor) -> None:
    """Re-import every peer whose published incarnation changed (it restarted)."""
    for peer in ex.peers:
        try:
            got = ex.control.peer_info(peer, wait=False)
        except ForgedRecordError as e:
            log.warning("rank %d: %s; keeping the imported peer", ex.rank, e)
            continue
        except Exception as e:  # noqa: BLE001 - the store may be gone: nothing to re-import
            log.info("rank %d: reading rank %d's record failed, no peer re-imported: %s: %s",
                     ex.rank, peer, type(e).__name__, e)
            return
        if got is None or got[0].inc == ex.inbox.incarnations.get(peer):
            continue
        rec, info = got
        try:
            ex._check_peer(peer, info)
            ex.control.accept_gen(peer, rec)
        except (ForgedRecordError, PeerMismatchError) as e:
            log.warning("rank %d: %s; keeping the imported peer", ex.rank, e)
            continue
        _reimport(ex, peer, rec, info)
    ex.inbox.foreign = False


def _reimport(ex: Executor, peer: int, rec: object, info: dict) -> None:
    entries: list[Prepared] = [e for st in ex.stages for e in st.batches if e.peer == peer]
    for e in entries:
        ex.transport.release(e.handle)
        e.handle = None
    ex.import_peer(peer, rec, info)
    for e in entries:
        e.handle = ex.transport.prepare(e.batch)
    ex.reimports += 1
