"""The executor: replays a compiled plan every RL step with one-sided writes.

    plan = executor.load("plan.rplan", rank, dict(model.named_parameters()),
                         transport="nixl", rendezvous="host:port")   # or LoadOptions(...)
    stats = executor.run(plan)
"""

from .chunked import ChunkedShadow, ChunkedStats, load_chunks, run_chunks
from .core import Executor, load, run
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
    PlanDeadlockError,
    TornUpdateError,
    TransportOptionError,
)
from .options import LoadOptions
from .rendezvous import connect_store
from .shadow import Shadow
from .stats import RunStats, ShadowStats
from .world import run_all_local

__all__ = ["BindError", "ChunkedShadow", "ChunkedStats", "Executor", "ForgedRecordError",
           "LeaseHeldError", "LeaseLostError", "LoadOptions", "NoSecretError",
           "PeerAbortError", "PeerLostError", "PeerMismatchError", "PeerTimeoutError",
           "PlanBoundsError", "PlanDeadlockError", "RunStats", "Shadow", "ShadowStats",
           "TornUpdateError", "TransportOptionError", "connect_store", "load", "load_chunks",
           "run", "run_all_local", "run_chunks"]
