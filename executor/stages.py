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
from .quant import prepare_quants
from .transports.base import Prepared, Transport, WriteBatch
from .transports.graphs import as_graph


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


def prepare_stage(plan: RankPlan, s: int, regions: list[torch.Tensor],
                  transport: Transport) -> Stage:
    """Stage `s` of `plan`: its signals, waits, copy views and prepared write batches."""
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
    st.packs = prepare_copies(c, np.flatnonzero((c["stage"] == s) & (c["kind"] == PACK)),
                              regions)
    st.packs += prepare_quants(
        c, np.flatnonzero((c["stage"] == s) & (c["kind"] == QUANT)), regions)
    st.unpacks = prepare_copies(
        c, np.flatnonzero((c["stage"] == s) & (c["kind"] == UNPACK)), regions)
    if transport.capabilities.graph_ops and regions:  # one launch each (graphs.py)
        dev = regions[0].device
        st.packs = as_graph(st.packs, dev, f"rank {p.rank} stage {s} packs")
        st.unpacks = as_graph(st.unpacks, dev, f"rank {p.rank} stage {s} unpacks")
    w, b = p.writes, p.batches
    batches = [np.arange(int(b["start"][i]), int(b["stop"][i]))
               for i in np.flatnonzero(b["stage"] == s)]
    if transport.capabilities.fuse_batches and batches:  # one batch per peer
        batches = [np.concatenate(batches)]
    for rows in batches:
        dst = w["dst_rank"][rows]
        for peer in dict.fromkeys(dst.tolist()):
            r = rows[dst == peer]
            batch = WriteBatch(peer, *(w[k][r].astype(np.int64) for k in (
                "src_region", "src_offset", "dst_region", "dst_offset", "nbytes")))
            st.batches.append(Prepared(transport.prepare(batch), peer, batch))
    return st
