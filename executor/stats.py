"""What `run()` returns."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.header import PlanHeader


@dataclass(frozen=True, slots=True)
class RunStats:
    rank: int
    """Plan rank, or -1 for a whole in-process world (`run_all_local`)."""
    step: int
    sent: int
    """Bytes this rank wrote to its peers (all ranks' bytes for a world)."""
    received: int
    """Bytes the plan writes into this rank (its peers' writes; the header's rank stats)."""
    seconds: float
    complete: bool
    """Whether this rank's part of the step finished (targets: weights are whole)."""
    waited: float = 0.0
    """Seconds of `seconds` spent waiting: for peers' signals, for writes to land, for this
    rank's own queued kernels. The rest is host work (`host_seconds`)."""
    graphed: bool = False
    """`run_all_local`: the step was one launch of the whole step's CUDA graph."""

    @property
    def host_seconds(self) -> float:
        """Seconds of the step the host spent working, not waiting."""
        return self.seconds - self.waited

    @property
    def bytes(self) -> int:
        """Bytes this rank moved: sent (sources) or received (targets)."""
        return self.sent or self.received

    @property
    def gbytes_per_s(self) -> float:
        """`bytes / seconds` in GB/s (10^9 bytes per second; configs' `nic_gbps` is Gb/s)."""
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def received_bytes(header: PlanHeader, rank: int) -> int:
    """Bytes the plan writes into `rank` per step (the header's rank stats), or 0."""
    rows = header.rank_stats
    return max(0, rows[rank].bytes_in) if 0 <= rank < len(rows) else 0


@dataclass(frozen=True, slots=True)
class ShadowStats:
    """One update through a shadow (`executor/shadow.py`)."""

    step: int
    version: int
    """Updates switched into the live tensors so far, this one included."""
    transfer_s: float
    """`start()` to the step's last DONE (and its unpacks) on this rank."""
    pause_s: float
    """The switch: shadow -> live copies (what the engine pauses for)."""
    extra_bytes: int
    """Memory the shadow costs on this rank (the target's weight bytes)."""
    run: RunStats
    """The executor's stats of the step."""
    switched_bytes: int = 0
    """Bytes the switch copied: the plan's switch ops (`target.shadow: full`), else every
    shadow byte."""
