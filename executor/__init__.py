"""The executor: replays a compiled plan every RL step with one-sided writes.

    plan = executor.load("plan.rplan", rank, dict(model.named_parameters()),
                         transport="nixl", rendezvous="host:port")
    stats = executor.run(plan)
"""

from schemas.identity import IdentityError

from .bounded import BoundedShadow, BoundedStats, load_chunks, run_chunks
from .core import Executor, RunStats, load, run
from .errors import (
                     BindError,
                     ForgedRecordError,
                     LeaseHeldError,
                     LeaseLostError,
                     NoSecretError,
                     PeerAbortError,
                     PeerLostError,
                     PeerMismatchError,
                     PeerTimeoutError,
                     PlanBoundsError,
)
from .rendezvous import connect_store
from .shadow import Shadow, TornUpdateError, shadow_extra_bytes
from .stats import ShadowStats
from .world import PlanDeadlockError, run_all_local

__all__ = ["BindError", "BoundedShadow", "BoundedStats", "Executor", "ForgedRecordError",
           "IdentityError", "LeaseHeldError",
           "LeaseLostError", "NoSecretError", "PeerAbortError", "PeerLostError",
           "PeerMismatchError", "PeerTimeoutError", "PlanBoundsError", "PlanDeadlockError",
           "connect_store",
           "RunStats", "Shadow", "ShadowStats", "TornUpdateError", "load", "run", "run_all_local",
           "shadow_extra_bytes", "load_chunks", "run_chunks"]
