"""What `load` takes besides the plan, the rank and the tensors: one typed record, shared by
every way a plan is loaded (`executor.load`, `Shadow.load`, `ChunkedShadow.load`,
`load_chunks`) and by `Executor` itself.

    executor.load(path, rank, tensors, LoadOptions(transport="nixl", rendezvous="h:29500"))
    executor.load(path, rank, tensors, transport="nixl", rendezvous="h:29500")  # the same

The keywords are the record's fields, checked by name: an unknown one is refused in one
line naming it and the fields there are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from schemas.protocol import INFLIGHT


@dataclass(frozen=True)
class LoadOptions:
    transport: str = "nixl"
    """`nixl`, `cuda_ipc`, `uccl` or `local` (`transports.TRANSPORTS`)."""
    rendezvous: object = None
    """'host:port' (rank 0 hosts a TCPStore there), a torch Store, or for `local` a
    `Fabric` (None: the process's default fabric)."""
    timeout_s: float = 60.0
    """How long a step waits for a peer before it raises `PeerTimeoutError`."""
    max_inflight: int = INFLIGHT
    """Write batches in flight at once (at least 1)."""
    plan_key: bytes | str | None = None
    """Refuse a plan not signed with this key (bytes, or a key file's path)."""
    identity: dict | None = None
    """This process's coordinates (`schemas/identity.py`): a plan rank with other
    coordinates, or whose part was compiled for others, is refused before registration."""
    no_identity: bool = False
    """Load without `identity` (logged); else a load without one is refused (`trust.py`)."""
    secret: bytes | str | None = None
    """The job secret (else `RDMA_PLAN_SECRET`; `auth.py`)."""
    insecure: bool = False
    """Run without a job secret (logs a warning)."""
    transport_options: dict[str, Any] | None = None
    """The transport's options dataclass as a dict, e.g. `{"streams": 2}` for cuda_ipc
    (`transports/options.py`)."""
    step_records: bool = True
    """Publish each step's record (where a restarted peer joins, `recovery.py`); off where
    no process can join: `run_all_local` holds every rank for one call."""
    max_staging_bytes: int | None = None
    """Most staging the rank allocates (None: `check.py`'s default cap)."""
    pack_groups: int | None = None
    """A stage's packs in this many growing groups (`pipeline.py`; None: its default, 0:
    whole)."""

    @staticmethod
    def of(options: LoadOptions | None, fields: dict[str, Any]) -> LoadOptions:
        """`options` (None: the defaults) with `fields` (keyword arguments) set."""
        if options is not None and not isinstance(options, LoadOptions):
            raise TypeError(f"load options are a {type(options).__name__}; pass "
                            "LoadOptions(...) or its fields as keywords (transport=..., "
                            "rendezvous=...)")
        names = [f.name for f in dataclasses.fields(LoadOptions)]
        bad = [k for k in fields if k not in names]
        if bad:
            raise TypeError(f"load option {bad[0]!r} does not exist; the options are "
                            f"{', '.join(names)}")
        base = LoadOptions() if options is None else options
        return dataclasses.replace(base, **fields) if fields else base
