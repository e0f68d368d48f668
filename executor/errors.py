"""The executor's errors: each names the rank, peer, op or tensor and says what to do."""

from __future__ import annotations

from schemas.errors import UserError


class BindError(UserError):
    """The tensors given to `load` do not match the plan's regions (every problem listed)."""


class PlanBoundsError(UserError):
    """An op of the plan reaches outside its regions, or names an unknown region/kind/dtype."""


class PeerMismatchError(UserError, RuntimeError):
    """A peer runs another plan (fingerprint, or its own part's digest) or exported regions
    of other sizes: the ranks were given different plans or tensors."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class PeerTimeoutError(TimeoutError):
    """A peer did not publish, complete or signal within `timeout_s`."""

    def __init__(self, rank: int, peer: int, what: str, timeout_s: float) -> None:
        super().__init__(f"rank {rank}: peer rank {peer} did not {what} within {timeout_s:g} s; "
                         f"check that rank {peer} is running the same plan and is reachable")
        self.rank = rank
        self.peer = peer


class PeerLostError(PeerTimeoutError):
    """The transport reported a peer gone (connection reset, failed write) during a step."""

    def __init__(self, rank: int, peer: int, what: str, cause: BaseException) -> None:
        TimeoutError.__init__(self, f"rank {rank}: peer rank {peer} is lost: could not {what} "
                              f"({type(cause).__name__}: {cause}); restart rank {peer} and "
                              "run again (the next run() re-imports it)")
        self.rank = rank
        self.peer = peer


class PeerAbortError(PeerTimeoutError):
    """A peer gave up the step and said so (`ABORT`): `.sender` aborted, `.peer` is the rank
    it blames (the one it lost), never the messenger."""

    def __init__(self, rank: int, sender: int, blamed: int, step: int) -> None:
        TimeoutError.__init__(self, f"rank {rank}: peer rank {sender} aborted step {step}: it "
                              f"lost rank {blamed}; restart rank {blamed} if it is gone, then "
                              "run again on every rank")
        self.rank, self.sender, self.peer = rank, sender, blamed


class NoSecretError(UserError):
    """No job secret was given and `insecure=True` was not passed."""


class ForgedRecordError(RuntimeError):
    """A store record is garbage, unsigned, forged, moved or replayed (`.key` names it)."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class LeaseHeldError(RuntimeError):
    """Another live process holds this rank's lease (one rank, one process)."""


class LeaseLostError(RuntimeError):
    """This process's lease was taken over by a newer process of its rank: it must stop."""


class RendezvousError(UserError, RuntimeError):
    """The rendezvous store could not be hosted or reached (names the address and the fix)."""


class TransportOptionError(UserError):
    """An unknown transport, or an option it does not have or of the wrong type."""


class PlanDeadlockError(UserError, RuntimeError):
    """A rank waits for a signal that no earlier step of the protocol sends."""


class TornUpdateError(RuntimeError):
    """An update did not complete and no version was committed (here: the shadow step did
    not complete, the live weights are untouched). The base of the integrations' own
    `TornUpdateError`s (vLLM, SGLang), so `except executor.TornUpdateError` catches all."""



class PlanSwitchError(UserError):
    """The new plan needs other memory, peers or job than the loaded one: load it instead."""
