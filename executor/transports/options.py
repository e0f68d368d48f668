"""Each transport's typed options (`executor.load(..., transport_options={...})`).

Which class belongs to which transport is `transports.TRANSPORTS`' to say (the one table).

Frozen dataclasses with a docstring under every field; `parse` checks the caller's dict
against the transport's dataclass and names the key, the value and the allowed ones. No
torch and no transport library is imported here, so a bad name or option is reported before
anything is loaded, bound or registered.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import TransportOptionError


@dataclass(frozen=True, slots=True)
class NixlOptions:
    backends: tuple[str, ...] = ("UCX",)
    """NIXL backends to create (UCX: RDMA, TCP, shared memory, CUDA IPC)."""
    progress_thread: bool = False
    """NIXL's progress thread (it spins a share of a core while idle); off: `done()` polls."""
    sgl: bool = True
    """A batch's writes as one scatter-gather put (NIXL_UCX_SGL_ENABLE): over CUDA IPC one
    `cuMemcpyBatchAsync` and one event per batch instead of a copy and an event per write
    (BENCHMARKS.md, "GPU refit", compares both)."""


@dataclass(frozen=True, slots=True)
class CudaIpcOptions:
    streams: int = 4
    """Copy streams per rank; batches take them in turn, so up to this many copy engines work
    at once (one stream's peer copies run one after another)."""
    graphs: bool = True
    """Capture a batch of several small copies once into a CUDA graph and replay it (one
    launch instead of a `cudaMemcpyAsync` per copy, each a few microseconds of host time)."""
    graph_branches: int = 16
    """Parallel branches of a batch captured as one CUDA graph of copy-engine copies (a
    branch's copies run one after another, the branches side by side, so several copy
    engines work at once). On one H200 a batch of 4 MiB copies reaches one `copy_`'s rate
    on 16 branches, not on 4, and 1 MiB copies gain too; each branch adds a little to the
    graph's launch (BENCHMARKS.md, "Executor")."""
    graph_min_copies: int = 2
    """Batches of fewer copies are posted copy by copy."""
    graph_max_mean_bytes: int = 16 << 20
    """Batches whose copies average this or more are posted copy by copy (for a few large
    copies a graph launch saves no host time and costs some)."""
    copy_kernel: bool = True
    """A batch's copies as one kernel on the SMs (`copy_kernel.py`) instead of the copy
    engines, where its copies average under `kernel_max_mean_bytes` (a peer on another
    GPU: `peer_kernel_max_mean_bytes`); false keeps the SMs free for compute running
    beside the transfer."""
    kernel_max_mean_bytes: int = 32 << 20
    """Batches into a peer on this GPU whose copies average this or more go through the
    copy engines: there the engines overtake the kernel on one GPU (BENCHMARKS.md,
    "Executor")."""
    engines_min_bytes: int = 4 << 20
    """Batches into a peer on this GPU whose every copy is at least this long go to the copy
    engines as one CUDA graph of `graph_branches` branches, whatever `kernel_max_mean_bytes` and
    `graph_max_mean_bytes` say: copies of 4 MiB and more run there at one `copy_`'s rate,
    where the kernel reaches ~0.93 of it. One short copy keeps the batch off this path (an
    engine's copy costs a few microseconds however short: 1 MiB copies run at ~0.75 of the
    rate on 8 branches); BENCHMARKS.md, "Executor"."""
    peer_kernel_max_mean_bytes: int = 32 << 20
    """The same for a peer on another GPU (the kernel writes over NVLink); where
    the engines overtake the kernel: BENCHMARKS.md, "Executor against a raw copy on GPU"."""
    beside_packs_max_mean_bytes: int = 4 << 20
    """The same for a batch posted while the next pack group runs (`beside_packs`): its
    copies share the SMs with the FP8 quantizer there, so from this mean size on they go
    to the engines."""
    beside_packs_kernel_share: float = 1.0
    """The share of the device's blocks the copy kernel's grid takes for a `beside_packs`
    batch that stays on it (under `beside_packs_max_mean_bytes`): below 1, the FP8
    quantizer running meanwhile finds room on every SM."""
    memcpy_batch: bool = True
    """A batch into a peer on another GPU as one `cuMemcpyBatchAsync` (the driver's batched
    copies, on the copy engines) where the driver has it, instead of the copy kernel or a
    CUDA graph of copies: NVLink at the copy engines' rate with no per-copy cost, and the
    SMs free for the FP8 quantizer meanwhile."""
    memcpy_batch_first: int = 4
    """Copies in a batch's first `cuMemcpyBatchAsync` call; each next call queues twice the
    last (the link starts after a few copies are queued, not after the whole batch)."""
    memcpy_batch_most: int = 128
    """The most copies one such call queues."""
    peer_streams: bool = True
    """Such batches into one peer go on one copy stream (peers take the streams in turn),
    so they land in the order posted: a stage's early QUANTs that wait for an older stage's
    writes to land (staging halves) then start as the next stage's writes begin, not when
    batches running side by side on the link all end."""
    device_signals: bool = True
    """A stage's DONE published by the GPU once its copies have landed (a stream write into
    the peer's shared-memory ring), not by this host after it saw them land."""


@dataclass(frozen=True, slots=True)
class UcclOptions:
    num_cpus: int = 4
    """CPU threads of the UCCL endpoint."""


@dataclass(frozen=True, slots=True)
class LocalOptions:
    copy_kernel: bool = True
    """On a GPU, a batch's copies as one kernel (`copy_kernel.py`) instead of torch's
    `_foreach_copy_` and slice copies."""
    step_graph: bool = True
    """`run_all_local` on one GPU: from the second step on, the whole step (every rank's
    packs, writes and unpacks, in the order the first step ran them) is one CUDA graph
    launch, without the host protocol (`world.py`)."""


def parse(kind: str, cls: type, options: dict[str, Any] | None) -> Any:
    """The options dataclass `cls` of transport `kind` from a dict (None: the defaults)."""
    if options is None:
        return cls()
    if not isinstance(options, dict):
        raise TransportOptionError(f"transport_options is a {type(options).__name__}; pass "
                                   f"a dict of {cls.__name__}'s fields")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in options.items():
        if key not in fields:
            raise TransportOptionError(
                f"transport_options[{key!r}]: transport {kind!r} has no such option; it has "
                f"{', '.join(fields) or 'none'}")
        default = fields[key].default
        ok = isinstance(value, type(default)) and not (
            isinstance(value, bool) and not isinstance(default, bool))
        if isinstance(default, tuple):
            ok = isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)
            options = {**options, key: tuple(value)} if ok else options
        if not ok or (type(default) is int and value < 1):
            raise TransportOptionError(
                f"transport_options[{key!r}] = {value!r}: expected "
                f"{'a positive int' if type(default) is int else type(default).__name__}")
    return cls(**options)
