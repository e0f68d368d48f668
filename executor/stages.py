"""What one rank does in one stage, prepared once at connect (the interpreter replays it).

Signals and waits by kind, the copy views of its packs/QUANTs and unpacks, and the write
batches (one per destination per plan batch) prepared by the transport. A transport that
queues its copies on the GPU says so (`fuse_batches`: a stage's batches become one per
destination, posted as one launch; `graph_ops`: packs and unpacks become one CUDA graph
each): the plan's batches size NIC work queues, which a copy engine does not need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from schemas.plan import ACK, DONE, PACK, QUANT, READY, SLOT_ACK, UNPACK, RankPlan

from .copies import Op, prepare_copies
from .gpu.graphs import as_graph
from .pipeline import split
from .quant import prepare_quants
from .transports.base import Prepared, Transport, WriteBatch


@dataclass(slots=True)
class Stage:
    """What one rank does in one stage, prepared once."""

    ready_to: list[int] = field(default_factory=list)
    before: list[tuple[int, int, int]] = field(default_factory=list)  # (stage, kind, peer)
    packs: list[Op] = field(default_factory=list)
    batches: list[Prepared] = field(default_factory=list)
    done_to: list[int] = field(default_factory=list)
    after: list[tuple[int, int, int]] = field(default_factory=list)
    unpacks: list[Op] = field(default_factory=list)
    ack_to: list[int] = field(default_factory=list)
    slot_ack_to: list[int] = field(default_factory=list)
    pipeline: list[tuple[list[Op], list[Prepared]]] = field(default_factory=list)
    """Where the packs run in groups (`pipeline.py`): (a group's ops, the writes posted
    right after them), in order; `packs` and `batches` are then these, concatenated."""
    group_rows: list[np.ndarray] = field(default_factory=list)
    """The copy rows of each group of `pipeline` (after its first entry: writes only)."""
    blocked: list[frozenset[int]] = field(default_factory=list)
    """Per entry of `pipeline`: ids of earlier batches that must land before its copies
    run (`pipeline.link`)."""


def prepare_stage(plan: RankPlan, s: int, regions: list[torch.Tensor],
                  transport: Transport, groups: int = 0, beside: bool = False) -> Stage:
    """Stage `s` of `plan`: its signals, waits, copy views and prepared write batches;
    `groups` > 0: its packs in up to that many groups, each followed by the writes that
    read what it wrote (`pipeline.py`), where the stage allows it; `beside`: every write
    batch of the stage runs beside a later stage's early QUANTs (`pipeline.beside_quants`),
    so all of them are `WriteBatch.beside_packs`."""
    p, st = plan, Stage()
    for table, sent in ((p.signals, True), (p.waits, False)):
        rows = np.flatnonzero(table["stage"] == s)
        for kind, peer in zip(table["kind"][rows].tolist(), table["peer"][rows].tolist()):
            if sent:
                {READY: st.ready_to, DONE: st.done_to, ACK: st.ack_to,
                 SLOT_ACK: st.slot_ack_to}[kind].append(peer)
            else:
                (st.after if kind == DONE else st.before).append((s, kind, peer))
    c = p.copies
    packing = np.flatnonzero((c["stage"] == s) & ((c["kind"] == PACK) | (c["kind"] == QUANT)))
    w, b = p.writes, p.batches
    batches = [np.arange(int(b["start"][i]), int(b["stop"][i]))
               for i in np.flatnonzero(b["stage"] == s)]
    graphs = transport.capabilities.graph_ops and bool(regions)
    cut = split(p, packing, np.concatenate(batches), max(1, groups)) \
        if groups > 0 and batches else None
    if cut is None:
        st.packs = _packs(c, packing, regions, graphs, p.rank, s)
    st.unpacks = prepare_copies(
        c, np.flatnonzero((c["stage"] == s) & (c["kind"] == UNPACK)), regions)
    if graphs:  # one launch each (graphs.py)
        st.unpacks = as_graph(st.unpacks, regions[0].device, f"rank {p.rank} stage {s} unpacks")
    if transport.capabilities.fuse_batches and batches:  # one batch per peer
        batches = [np.concatenate(batches)]
    if cut is None:
        st.batches = _prepare(batches, w, transport, beside)
        return st
    groups_rows, dep = cut
    st.group_rows = groups_rows
    dep_of = np.full(len(w), -1, dtype=np.int64)
    dep_of[np.concatenate(batches)] = dep
    for g in range(-1, len(groups_rows)):
        ops = _packs(c, groups_rows[g], regions, graphs, p.rank, s) if g >= 0 else []
        entries = _prepare([r[dep_of[r] == g] for r in batches], w, transport,
                           beside=beside or g < len(groups_rows) - 1)
        st.pipeline.append((ops, entries))
        st.packs += ops
        st.batches += entries
    return st


def _packs(c, rows: np.ndarray, regions: list[torch.Tensor], graphs: bool, rank: int,
           s: int) -> list[Op]:
    """The ops of PACK/QUANT copies `rows` (in one CUDA graph where `graphs`)."""
    ops = prepare_copies(c, rows[c["kind"][rows] == PACK], regions)
    ops += prepare_quants(c, rows[c["kind"][rows] == QUANT], regions)
    return as_graph(ops, regions[0].device, f"rank {rank} stage {s} packs") if graphs else ops


def _prepare(batches: list[np.ndarray], w, transport: Transport, beside: bool = False
             ) -> list[Prepared]:
    """One prepared batch per plan batch (of write rows) and destination peer; `beside`:
    posted while a pack group runs (`WriteBatch.beside_packs`)."""
    out = []
    for rows in batches:
        dst = w["dst_rank"][rows]
        for peer in dict.fromkeys(dst.tolist()):
            r = rows[dst == peer]
            batch = WriteBatch(peer, *(w[k][r].astype(np.int64) for k in (
                "src_region", "src_offset", "dst_region", "dst_offset", "nbytes")), beside)
            out.append(Prepared(transport.prepare(batch), peer, batch))
    return out
