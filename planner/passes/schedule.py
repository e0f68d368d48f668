"""Pass 10 (`schedule`): per-NIC batches in an incast-avoiding order, signals, the DAG.

Within a stage, a source's writes to one target are cut into batches of at most
`max_write_bytes` (and 1024 writes). Batches go out in rounds: round k holds every
target's k-th batch, and source i visits targets in an order rotated by `i * spread(n)`
(n targets; `spread`: odd, coprime with n), so at any moment the sources spread over
different targets instead of all hitting the first (sources i and j start at the same
target only where i = j mod n, as with a rotation by i), and the sources that feed one
target reach it at times spread over the stage: a run of consecutive ranks (the ranks
holding neighbouring rows of a tensor, or the experts a target takes) as well as a stride of
them (one TP rank of every group), where a rotation by i lets a run of consecutive ranks
reach it all in one part of the stage and leaves it idle in the rest.

Signals (see `schemas.plan`): every (source, target) pair with writes exchanges READY
(stage 0) and, per stage with writes, DONE; a target whose staging is written in stage
s >= 1 ACKs stage s-1 to the writer. The DAG has one node per (rank, stage, phase) and
must be acyclic (proved by every edge going forward in (stage, phase), else checked with
networkx).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx
import numpy as np

from planner.passes.lower import Lowered
from planner.rows import Scratch, distinct_rows, lexorder, lexorder_or_none
from planner.topology import Topology
from schemas.plan import ACK, DONE, READY, SLOT_ACK
from schemas.protocol import sent_stage, wait_stage

MAX_BATCH_WRITES = 1024
GOLDEN = (5 ** 0.5 - 1) / 2
"""The golden ratio's fraction: the best spread of multiples (`spread`)."""
PHASES = ("ready", "pack", "write", "done", "unpack", "ack")


@dataclass(frozen=True, slots=True)
class Schedule:
    order: np.ndarray
    """Permutation of the lowered writes: per source rank, stage, round, target."""
    batch_start: np.ndarray
    """Index (in `order`) where each batch starts; batches never span ranks or stages."""
    batch_nic: np.ndarray
    """0: the rank's NIC; 1: NVLink (target on the same host)."""
    signals: np.ndarray
    """Columns rank, stage, peer, kind: signals sent."""
    waits: np.ndarray
    """Columns rank, stage, peer, kind: signals awaited."""
    dag_nodes: np.ndarray
    """Columns rank, stage, phase of each DAG node."""
    dag_edges: np.ndarray
    """Columns u, v (node indices)."""


def schedule(low: Lowered, topo: Topology, max_write_bytes: int,
             n_regions: np.ndarray) -> Schedule:
    src, dst, stage = low.w_src_rank, low.w_dst_rank, low.w_stage
    n = len(src)
    # writes grouped by (src, stage, dst); None: so already (`coalesce` leaves them so)
    group = lexorder_or_none(dst, stage, src)
    g_src, g_stage, g_dst = (src, stage, dst) if group is None else \
        (src[group], stage[group], dst[group])
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = (g_src[1:] != g_src[:-1]) | (g_stage[1:] != g_stage[:-1]) | \
        (g_dst[1:] != g_dst[:-1])
    gstart = np.nonzero(new_group)[0]
    del new_group
    # bytes and writes before each write in its group (each whole column made once)
    rnd = _before_in_group(low.w_nbytes if group is None else low.w_nbytes[group], gstart)
    pos = _before_in_group(np.ones(n, dtype=np.int8), gstart)
    del gstart
    rnd //= max_write_bytes
    pos //= MAX_BATCH_WRITES
    np.maximum(rnd, pos, out=rnd)
    del pos
    nt = max(topo.targets, 1)
    step = spread(nt)  # (g_dst - sources + g_src * step) % nt, in int32 where it fits
    rot = g_src.astype(np.int32 if topo.world * (step + 2) < 1 << 31 else np.int64)
    rot *= step
    rot += g_dst
    rot -= topo.sources
    rot %= nt
    del g_dst
    order = lexorder(rot, rnd, g_stage, g_src)  # stable: ties keep group order
    del rot, g_stage, g_src
    if group is None:
        key_rnd = rnd
    else:
        order = group[order]
        key_rnd = np.empty(n, dtype=np.int64)
        key_rnd[group] = rnd
    del group, rnd
    new_batch = np.zeros(n, dtype=bool)
    new_batch[:1] = True
    scratch = Scratch()  # one buffer each column is put in order into, in turn
    for col in (src, stage, dst, key_rnd):
        o = scratch.taken(col, order)
        new_batch[1:] |= o[1:] != o[:-1]
    del key_rnd, scratch, o
    batch_start = np.nonzero(new_batch)[0]
    del new_batch
    host = np.asarray(topo.host)
    batch_nic = (host[src[order[batch_start]]] == host[dst[order[batch_start]]]).astype(
        np.int64)
    signals, waits = _signals(low, n_regions, topo.sources)
    nodes, edges = _dag(low.stages, topo.world, signals)
    return Schedule(order, batch_start, batch_nic, signals, waits, nodes, edges)


def _before_in_group(values: np.ndarray, gstart: np.ndarray) -> np.ndarray:
    """The sum (int64) of `values` before each row in its group, the groups being the runs
    of rows from each of `gstart` (ascending, the first 0): one cumulative sum, each
    group's start less the sum of the group before it."""
    out = np.zeros(len(values), dtype=np.int64)
    if len(values) == 0:
        return out
    out[1:] = values[:-1]
    out[gstart[1:]] -= np.add.reduceat(values, gstart, dtype=np.int64)[:-1]
    return np.cumsum(out, out=out)


def spread(n: int) -> int:
    """The step between the first targets of consecutive sources among `n` targets: the
    first integer from `n` times the golden ratio's fraction (0.618...) up that is coprime
    with `n` (so `i * spread(n) mod n` is a permutation of the sources' residues). Its
    multiples mod `n` are nearly evenly spread for any run of consecutive sources (the
    three-distance theorem) and, `n` being a power of two, exactly even for a run at a
    power-of-two stride."""
    step = max(1, round(n * GOLDEN))
    while math.gcd(step, n) != 1:
        step += 1
    return step


def _unique_rows(*cols: np.ndarray) -> np.ndarray:
    if len(cols[0]) == 0:
        return np.zeros((0, len(cols)), dtype=np.int64)
    return distinct_rows(cols)  # = unique_rows(np.stack(cols, axis=1))


def _signals(low: Lowered, n_regions: np.ndarray, sources: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """(rank, stage, peer, kind) rows of signals sent and awaited."""
    d = low.w_dst_rank
    slot = low.slotted & (d >= sources)  # the direct path's target staging
    if low.sources_slotted >= 0:  # a gather's, in halves (`gather_out.lowered`)
        slot |= (d < sources) & (low.w_stage >= low.sources_slotted)
    return signal_rows(low.w_src_rank, d, low.w_stage, _into_staging(low, n_regions), slot)


def _into_staging(low: Lowered, n_regions: np.ndarray) -> np.ndarray:
    """Whether each write lands in its target's staging (the region after its tensors),
    a block at a time (`n_regions[d]` of every write at once is a column of int64)."""
    d, out = low.w_dst_rank, np.empty(len(low.w_dst_rank), dtype=bool)
    buf = np.empty(min(len(d), _BLOCK), dtype=n_regions.dtype)
    for lo in range(0, len(d), _BLOCK):
        part = buf[:len(d[lo:lo + _BLOCK])]
        np.take(n_regions, d[lo:lo + _BLOCK], out=part, mode="clip")  # (plan ranks)
        np.equal(low.w_dst_region[lo:lo + _BLOCK], part, out=out[lo:lo + _BLOCK])
    return out


_BLOCK = 1 << 20
"""Writes `_into_staging` reads at a time."""


def signal_rows(s: np.ndarray, d: np.ndarray, st: np.ndarray, staged: np.ndarray,
                slot: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The signals of writes (source rank `s`, target rank `d`, stage `st`, `staged`: lands
    in the target's staging; `slot`: that staging is used in slots), as (rank, stage,
    peer, kind) rows sent and awaited: READY (stage 0) per pair, DONE per pair and stage,
    and where the target's staging is written in stage s, an ACK of stage s-1 (s >= 1) or,
    slotted, a SLOT_ACK of stage s-SLOTS (s >= SLOTS) (hand-built plans in the tests derive
    theirs here)."""
    slot = np.zeros(len(s), dtype=bool) if slot is None else np.asarray(slot, dtype=bool)
    # the distinct writes' (s, d, st, staged, slot) in one sort; each set below from those
    u = _unique_rows(s, d, st, np.asarray(staged, dtype=bool), slot)
    s, d, st, staged, slot = u.T
    kind = np.where(slot, SLOT_ACK, ACK)
    pairs = _unique_rows(s, d)
    done = _unique_rows(s, d, st)
    into_staging = (staged != 0) & (sent_stage(kind, st) >= 0)
    ack = _unique_rows(s[into_staging], d[into_staging], st[into_staging], kind[into_staging])
    zeros = np.zeros(len(pairs), dtype=np.int64)
    sent = [
        np.stack([pairs[:, 1], zeros, pairs[:, 0], zeros + READY], axis=1),
        np.stack([done[:, 0], done[:, 2], done[:, 1], np.full(len(done), DONE)], axis=1),
        np.stack([ack[:, 1], sent_stage(ack[:, 3], ack[:, 2]), ack[:, 0], ack[:, 3]], axis=1),
    ]
    awaited = [
        np.stack([pairs[:, 0], zeros, pairs[:, 1], zeros + READY], axis=1),
        np.stack([done[:, 1], done[:, 2], done[:, 0], np.full(len(done), DONE)], axis=1),
        np.stack([ack[:, 0], ack[:, 2], ack[:, 1], ack[:, 3]], axis=1),
    ]
    return _sorted(np.concatenate(sent)), _sorted(np.concatenate(awaited))


def _sorted(rows: np.ndarray) -> np.ndarray:
    rows = rows.reshape(-1, 4).astype(np.int64)
    return rows[lexorder(rows[:, 3], rows[:, 2], rows[:, 1], rows[:, 0])]


def _forward(edges: np.ndarray, stages: int, nph: int) -> bool:
    """Whether every edge goes from an earlier (stage, phase) to a later one: then
    (stage, phase) orders the nodes topologically and the DAG has no cycle (networkx is
    asked only when this quick proof fails)."""
    time = edges % (stages * nph)  # node = (rank * stages + stage) * nph + phase
    return bool((time[:, 0] < time[:, 1]).all())


def _dag(stages: int, world: int, signals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nodes (rank, stage, phase) and edges; raises if the order has a cycle."""
    nph = len(PHASES)

    def node(rank, st, phase):
        return (rank * stages + st) * nph + phase

    ranks = np.repeat(np.arange(world), stages * nph)
    st = np.tile(np.repeat(np.arange(stages), nph), world)
    ph = np.tile(np.arange(nph), world * stages)
    nodes = np.stack([ranks, st, ph], axis=1)
    chain = np.arange(len(nodes) - 1)
    chain = chain[ranks[chain] == ranks[chain + 1]]  # phase -> next phase -> next stage
    edges = [np.stack([chain, chain + 1], axis=1)]
    r, s, peer, kind = signals.T
    phase_from = {READY: 0, DONE: 3, ACK: 5, SLOT_ACK: 5}
    phase_to = {READY: 2, DONE: 4, ACK: 2, SLOT_ACK: 2}
    for k in (READY, DONE, ACK, SLOT_ACK):
        m = kind == k
        to_stage = wait_stage(k, s[m])
        edges.append(np.stack([node(r[m], s[m], phase_from[k]),
                               node(peer[m], to_stage, phase_to[k])], axis=1))
    edges = np.concatenate(edges).astype(np.int64)
    if _forward(edges, stages, nph):
        return nodes, edges
    g = nx.DiGraph()
    g.add_nodes_from(range(len(nodes)))
    g.add_edges_from(map(tuple, edges.tolist()))
    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        raise RuntimeError(f"schedule: the stage DAG has a cycle through {cycle[:4]}; "
                           "this is a compiler bug, please report it with the config")
    return nodes, edges
