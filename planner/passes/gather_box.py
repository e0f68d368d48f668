"""The gather pass's data between its steps (`gather.py` row by row, `gather_rows.py` and
`gather_direct.py` as columns): a target box and what was decided for it (`Box`), where it
lives in its owner's staging (`Slot`), the one owner rule (`pick_owner`), and the state the
column steps read and extend (`GatherState`, which `gather.Gatherer` is)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from planner.passes.gather_out import Out, Staging, align
from planner.passes.intersect import Chunks, PieceTable
from schemas.protocol import scale_blocks


def pick_owner(ranks: np.ndarray, held: np.ndarray, load: np.ndarray, nic: np.ndarray,
               fanout: np.ndarray | None = None) -> int:
    """The owner of a box among `ranks`, `held[i]` of its elements on `ranks[i]`: the rank
    holding most; ties: the one whose NIC has sent the fewest bytes so far (`load[nic[r]]`),
    then the one that has fanned out the fewest bytes so far over any link (`fanout[r]`:
    on one host, where NICs carry none, replicated boxes would all fall to the lowest rank,
    whose copy engines then send more than the others'), then the lowest rank."""
    best = ranks[held == held.max()]
    if len(best) > 1:
        spread = fanout[best] if fanout is not None else np.zeros(len(best), dtype=np.int64)
        best = best[np.lexsort((best, spread, load[nic[best]]))]
    return int(best[0])


@dataclass(slots=True)
class Box:
    """One target box of the gather path and what was decided for it."""

    tensor: int
    t0: int
    t1: int
    n0: int
    n1: int
    chunks: range
    """Its chunks (rows of the chunk table), each fed by one source piece."""
    rows: tuple[int, ...]
    """The source piece row that sends each chunk."""
    owner: int
    """The source rank that gathers, converts and fans the box out."""
    sole: bool
    """Only `owner` holds any of it."""
    src_code: int
    out_code: int
    es: int
    """Element size at the sources."""
    es_d: int
    """Element size at the targets."""
    quant: bool
    cast: bool
    direct: bool
    """QUANT reads the owner's piece in place (an FP8 box it holds whole, in one piece)."""
    parts: bool
    """QUANT part by part: the other holders' parts land whole in the owner's staging."""
    g_bytes: int
    """Staging of the gathered box (or of the other holders' parts)."""

    @property
    def numel(self) -> int:
        return self.n0 * self.n1

    @property
    def f_bytes(self) -> int:
        return align(self.numel) if self.quant else \
            align(self.numel * self.es_d) if self.cast else 0

    @property
    def need(self) -> int:
        nscale = scale_blocks(self.n0, self.n1)
        return self.g_bytes + self.f_bytes + (align(nscale * 4) if self.quant else 0)


@dataclass(slots=True)
class Slot:
    """Where and when a box lives in its owner's staging."""

    gather: int
    """Stage of the gather (its parts land)."""
    convert: int
    """Stage of the conversion and the fan-out."""
    g_off: int
    """Byte offset of the gathered box."""
    f_off: int
    """Byte offset of the converted box (QUANT or cast)."""
    s_off: int
    """Byte offset of the FP8 scales."""


@dataclass(frozen=True, slots=True)
class TargetRows:
    """The columns of target piece rows (int64) that the pass reads once its boxes and
    scale rows are found; the other columns are not kept."""

    rank: np.ndarray
    region: np.ndarray
    base: np.ndarray
    a0: np.ndarray
    a1: np.ndarray
    dtype: np.ndarray

    @classmethod
    def of(cls, t: PieceTable) -> TargetRows:
        return cls(*(getattr(t, f) for f in cls.__slots__))


class GatherState(Protocol):
    """What the column steps read (the target rows, chunks, topology, NIC loads) and extend
    (the output, staging, rounds, the owner-only and largest-unit figures)."""

    w: TargetRows
    """The gathered target rows (int64 columns)."""
    s: TargetRows
    """The scale target rows."""
    src: PieceTable
    tboxes: np.ndarray
    """Distinct target boxes: (tensor, off0, off1, size0, size1) per row."""
    first: np.ndarray
    """A target row of each box."""
    chunks: Chunks
    chunk_ptr: np.ndarray
    chunk_ptr_l: list[int]
    multi: np.ndarray
    """Per box: some chunk of it has several holders."""
    by_parts: np.ndarray
    """Per box: cut into block-aligned parts, not all whole rows (`Gatherer._by_parts`)."""
    aligned: np.ndarray
    """Per box: cut into block-aligned parts."""
    targets_of: np.ndarray
    target_ptr: np.ndarray
    scale_j: np.ndarray
    """The scale target row of each target row (-1: none)."""
    n_regions: np.ndarray
    stg: list[int]
    """Each rank's staging region."""
    base: int
    host: list[int]
    host_a: np.ndarray
    nic_a: np.ndarray
    load: np.ndarray
    """Bytes each NIC sends to other hosts so far."""
    fanout: np.ndarray
    """Bytes each source rank's fan-outs send so far, over any link (the owners' tie-break)."""
    out: Out
    alloc: Staging
    rounds: dict[int, int]
    max_stage: int
    owner_only: np.ndarray
    unit_max: int

    def src_rows(self, rows: np.ndarray) -> PieceTable: ...

    def add(self, t: int) -> None: ...
