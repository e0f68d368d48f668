"""The simulator's inputs and outputs (`planner/tools/simulate.py` runs the model in between).

Inputs: the plan checked for order bounds (`load_checked`), every batch as columns
(`batch_columns`) and the time of a stage's packs or unpacks (`copy_seconds`); max-min fair
sharing of NIC and NVLink directions between flows is `planner.tools.simrates.maxmin`. Outputs:
the result dict (`result`; `planner/tools/simgap.py` turns it into the lines `rdma-plan simulate`
prints).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.rows import unique_rows
from planner.tools.planfile import PlanRanks, ticker
from schemas.bounds import order_violations
from schemas.errors import PlanFormatError
from schemas.header import PlanHeader
from schemas.plan import COPY_GROUP_KEY, PACK, QUANT, UNPACK, RankPlan
from schemas.protocol import ITEM, Overlap, carries, overlap, sent_stage
from schemas.protocol import KINDS as SIGNAL_KINDS
from schemas.table import among, content_key, table_digest

NIC, NVLINK = 0, 1
"""Channels of a source rank (the values of `batches.nic`)."""
MAX_LEVELS = 8
"""Progressive-filling levels computed exactly (see `planner.tools.simrates.maxmin`)."""
EXACT_MAX_BATCHES = 20_000
"""`simulate`'s "auto" model is exact up to this many batches (seconds of CPU), coarse above."""
COARSE_TOL = 0.2
"""The coarse model's quantum as a fraction of a batch's median time at full rate."""
COARSE_STATED = 0.005
"""How far the coarse model's estimate may be from the exact one's, as `simulate` states it
(a fraction of the exact estimate); `tests/planner/test_simcoarse.py` holds compiled plans
to it, and BENCHMARKS.md has the shipped plans' gaps."""
MAX_CELLS = 1 << 26
"""(rank, stage) queues the simulation indexes (ranks x stages)."""


@dataclass(frozen=True, slots=True)
class Batches:
    """Every batch of the plan, in (rank, plan order), as columns."""

    rank: np.ndarray
    stage: np.ndarray
    chan: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    writes: np.ndarray


@dataclass(slots=True)
class SimRank:
    """What the simulation keeps of one rank (its columns are dropped once read)."""

    rank: int
    stages: int
    batches: Batches
    pack_s: np.ndarray
    unpack_s: np.ndarray
    overlap: Overlap
    carries: list[bool]
    sends: list[dict[int, list[int]]]
    """Each stage's signals: kind -> peers, in plan order."""
    waits: list[list[tuple[int, int, int, int]]]
    """Each stage's waits, in plan order, as the key of the signal each matches: (from,
    to, kind, the stage it is sent in)."""


def sim_rank(rp: RankPlan, header: PlanHeader) -> SimRank:
    opts = header.options
    pbps, pov = opts.pack_gbps * 1e9 / 8, opts.pack_overhead_us * 1e-6
    return SimRank(rp.rank, rp.stages, batch_columns((rp,)),
                   copy_seconds(rp, (PACK, QUANT), pbps, pov),
                   copy_seconds(rp, (UNPACK,), pbps, pov), overlap(rp), carries(rp).tolist(),
                   sends_by_stage(rp), waits_by_stage(rp))


def load_checked(src: PlanRanks, progress: Callable[[str], None] | None = None
                 ) -> list[SimRank]:
    """Every rank of `src` as the simulation needs it, read one at a time (each blob's
    digest, compact frame and plain msgpack, as `load_plan` checks them), each rank's order
    within bounds (`schemas.bounds`: stages, peers, batches and signals in range, so the
    simulation terminates). The simulation reads the header and the rank blobs only: the
    blobs it never reads (the DAG, `explain`, `tensors/<rank>`) are left to the readers that
    use them (`verify` checks the whole file)."""
    world, header = src.world, src.header
    if len(header.ranks) != world:
        raise PlanFormatError(f"simulate: the header lists {len(header.ranks)} ranks, "
                              f"the plan has {world}; the file is corrupt")
    from schemas.config import MAX_GBPS

    for name, gbps in (("nvlink_gbps", header.nvlink_gbps),
                       *((f"nics[{i}].gbps", n.gbps) for i, n in enumerate(header.nics))):
        if not 0 < gbps <= MAX_GBPS:  # (NaN fails too)
            raise PlanFormatError(f"simulate: the header's {name} is {gbps!r}, not a bandwidth "
                                  f"in (0, {MAX_GBPS:g}] Gb/s; the file is corrupt")
    out, cells = [], 0
    tick = ticker(progress, "reading ranks", world)
    for r in range(world):
        rp = src.rank(r)
        for msg in order_violations(rp, world):
            raise PlanFormatError(f"simulate: {msg}")
        cells = max(cells, world * rp.stages)
        if cells > MAX_CELLS:
            raise PlanFormatError(f"simulate: {world} ranks x their stages is {cells:,} "
                                  f"(rank, stage) queues, more than {MAX_CELLS:,}; the plan is "
                                  "corrupt or too large to simulate")
        out.append(sim_rank(rp, header))
        tick(r)
    return out


def choose_quantum(model: str, full_rate_s: np.ndarray) -> float:
    """The landing quantum of `model` ("exact", "coarse" or "auto"; `full_rate_s`: each
    batch's time alone on its path). 0 is the exact model: every landing is an event and
    rates are recomputed after it. The coarse model lands every flow that ends within the
    quantum (`COARSE_TOL` of the median batch's time at full rate) of the first one together,
    with one rate computation for the group, when the group has moved its bytes in all (the
    rate-weighted mean of their ends, `planner.tools.simulate`): a flow lands at most a quantum
    early (its last bytes skipped) or late (its share idle meanwhile); the two offset each
    other, so the estimate's error is far below a quantum per batch (`COARSE_STATED`)."""
    if model not in ("auto", "exact", "coarse"):
        raise ValueError(f"simulate: model {model!r} is not one of auto, exact, coarse")
    if model == "exact" or (model == "auto" and len(full_rate_s) <= EXACT_MAX_BATCHES):
        return 0.0
    return float(COARSE_TOL * np.median(full_rate_s)) if len(full_rate_s) else 0.0


def initial_state(sim: Any) -> None:
    """The state of every rank, window and flow of `planner.tools.simulate._Sim` at t=0 (but
    its `RateCache`)."""
    w, nb, k = sim.world, len(sim.b.rank), sim.inflight
    sim.stage, sim.phase = [0] * w, [0] * w  # stage 0, waiting for READY/ACK (_WAIT_IN)
    sim.finish = [0.0] * w
    sim.heap = []  # (time, seq, rank) timers
    sim.seq = 0
    sim.arrival = {}  # (from, to, kind, stage) -> when a signal arrives
    sim.waiters = {}  # the same key -> ranks waiting for it
    sim.wait_t, sim.missing = [0.0] * w, [0] * w
    sim.window = [[0, 0, 0, 0] for _ in range(w)]
    sim.unlanded = [{} for _ in range(w)]  # stage -> batches
    sim.deferred = [set() for _ in range(w)]  # DONE sent when landed
    sim.hold = [0.0] * w  # a rank posts its carried stage's batches from then on
    sim.packs_after = [-1] * w  # a stage whose early packs wait for older writes
    sim.free_slots = [list(range(r * k + k - 1, r * k - 1, -1)) for r in range(w)]
    sim.active = np.zeros(w * k, dtype=bool)
    sim.rem = np.zeros(w * k)
    sim.gid = np.zeros(w * k, dtype=np.int64)  # each window slot's batch
    sim.f_eres = np.zeros(w * k, dtype=np.int64)
    sim.f_ires = np.zeros(w * k, dtype=np.int64)
    sim.start, sim.end = np.zeros(nb), np.zeros(nb)
    sim.lane = np.zeros(nb, dtype=np.int64)
    sim.dirty = False
    sim.landed = 0


def nic_order(name: str) -> tuple[int, str]:
    """NICs by host (`h<host>/...`), then name."""
    host = name.split("/")[0][1:]
    return (int(host) if host.isdigit() else -1, name)


def batch_columns(ranks: tuple[RankPlan, ...]) -> Batches:
    cols: dict[str, list[np.ndarray]] = {k: [] for k in Batches.__slots__}
    for rp in ranks:
        b, w = rp.batches, rp.writes
        if len(b) == 0:
            continue
        start, stop = b["start"].astype(np.int64), b["stop"].astype(np.int64)
        csum = np.concatenate([[0], np.cumsum(w["nbytes"], dtype=np.int64)])
        cols["rank"].append(np.full(len(b), rp.rank, dtype=np.int64))
        cols["stage"].append(b["stage"].astype(np.int64))
        cols["chan"].append(b["nic"].astype(np.int64))
        cols["dst"].append(w["dst_rank"][start].astype(np.int64))  # a batch has one target
        cols["nbytes"].append((csum[stop] - csum[start]).astype(np.float64))
        cols["writes"].append(stop - start)
    return concat_batches(cols)


def concat_batches(cols: dict[str, list[np.ndarray]]) -> Batches:
    return Batches(**{k: (np.concatenate(v) if v else np.zeros(0, dtype=np.int64))
                       for k, v in cols.items()})


_SECONDS: dict[bytes, np.ndarray] = {}
SECONDS_MAX = 1024


def copy_seconds(rp: RankPlan, kinds: tuple[int, ...], pack_bps: float,
                 overhead_s: float) -> np.ndarray:
    """Seconds of the copies of `kinds` in each stage of one rank: bytes (of the wider side)
    at `pack_bps`, plus `overhead_s` per executor op (a QUANT, or a group of PACKs or
    UNPACKs that run as one, `schemas.plan.COPY_GROUP_KEY`). Read-only; worked out once
    for ranks with equal copies and stages (every shard of a pipeline stage, every
    replica), kept by a digest of them."""
    if not len(rp.copies):
        return _copy_seconds(rp, kinds, pack_bps, overhead_s)
    key = content_key(table_digest(rp.copies), rp.stages, kinds, pack_bps, overhead_s)
    out = _SECONDS.get(key)
    if out is None:
        out = _copy_seconds(rp, kinds, pack_bps, overhead_s)
        out.flags.writeable = False
        if len(_SECONDS) >= SECONDS_MAX:
            _SECONDS.clear()
        _SECONDS[key] = out
    return out


def _copy_seconds(rp: RankPlan, kinds: tuple[int, ...], pack_bps: float,
                  overhead_s: float) -> np.ndarray:
    c = rp.copies
    out = np.zeros(rp.stages)
    m = among(c["kind"], kinds)
    if not m.any():
        return out
    item = np.maximum(ITEM[c["src_dtype"][m]], ITEM[c["dst_dtype"][m]])
    nbytes = (c["size0"][m] * c["size1"][m] * c["size2"][m] * item).astype(np.float64)
    np.add.at(out, c["stage"][m], nbytes / pack_bps)
    rows = np.flatnonzero(m)
    quant = c["kind"][rows] == QUANT
    np.add.at(out, c["stage"][rows[quant]], overhead_s)
    rows = rows[~quant]
    if len(rows):  # one op per distinct row of these columns (a column equal on every row
        # tells no two apart: left out), their stages in order
        cols = [c[k][rows] for k in ("kind", *COPY_GROUP_KEY)]
        key = np.stack([c["stage"][rows].astype(np.int64)]
                       + [x.astype(np.int64) for x in cols if x.min() != x.max()], axis=1)
        ops = unique_rows(key)
        np.add.at(out, ops[:, 0], overhead_s)
    return out


def sends_by_stage(rp: RankPlan) -> list[dict[int, list[int]]]:
    """A rank's signals as kind -> peers per stage, in plan order."""
    out: list[dict[int, list[int]]] = [{} for _ in range(rp.stages)]
    t = rp.signals
    for s, p, k in zip(t["stage"].tolist(), t["peer"].tolist(), t["kind"].tolist()):
        out[s].setdefault(k, []).append(p)
    return out


_LAG = {k: -sent_stage(k, 0) for k in SIGNAL_KINDS}
"""Stages between a signal of each kind being sent and the stage that waits for it."""


def waits_by_stage(rp: RankPlan) -> list[list[tuple[int, int, int, int]]]:
    """A rank's waits per stage, in plan order, each as the key of the signal it matches
    (from, to, kind, sent in) (`order_violations` let only known kinds in)."""
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in range(rp.stages)]
    t, r, lag = rp.waits, rp.rank, _LAG
    for s, p, k in zip(t["stage"].tolist(), t["peer"].tolist(), t["kind"].tolist()):
        out[s].append((p, r, k, s - lag[k]))
    return out


def result(sim: Any, busy: np.ndarray, events: int, wall: float) -> dict[str, Any]:
    """The result dict of a finished simulation `sim` (see `planner.tools.simulate.simulate`)."""
    b, n_nic = sim.b, len(sim.nic_names)
    load = np.bincount(sim.eres, weights=b.nbytes, minlength=len(sim.cap))
    load += np.bincount(sim.ires, weights=b.nbytes, minlength=len(sim.cap))
    floors = load / sim.cap
    worst = int(np.argmax(floors)) if len(floors) else 0
    floor = float(floors[worst]) if len(floors) else 0.0
    est = max(sim.finish, default=0.0)
    nics = [{"name": name, "bytes_out": int(load[i]), "bytes_in": int(load[n_nic + i]),
             "busy_out_s": float(busy[i]), "busy_in_s": float(busy[n_nic + i])}
            for i, name in enumerate(sim.nic_names)]
    nv = 2 * n_nic
    return {
        "estimated_s": float(est), "floor_s": floor,
        "ratio": float(est / floor) if floor > 0 else 1.0,
        "bottleneck": resource_name(sim, worst), "bottleneck_index": worst,
        "bytes": int(b.nbytes.sum()), "batches": int(len(b.rank)),
        "writes": int(b.writes.sum()), "stages": max(sim.stages, default=0),
        "nic_gbps": sim.nic_bps * 8 / 1e9, "nvlink_gbps": sim.nv_bps * 8 / 1e9,
        "nics": nics,
        "nvlink_bytes": int(load[nv:nv + sim.world].sum()),
        "nvlink_max_out_bytes": int(load[nv:nv + sim.world].max(initial=0)),
        "nvlink_max_in_bytes": int(load[nv + sim.world:].max(initial=0)),
        "rank_finish_s": [float(x) for x in sim.finish],
        "inflight": sim.inflight, "events": events,
        "model": "coarse" if sim.quantum else "exact", "quantum_s": sim.quantum,
        "sim_seconds": round(wall, 3),
        "timeline": {"start": sim.start, "end": sim.end, "rank": b.rank,
                     "chan": b.chan, "dst": b.dst, "bytes": b.nbytes,
                     "lane": sim.lane},
    }

def resource_name(sim: Any, i: int) -> str:
    """A resource index as a person reads it (a NIC direction or a rank's NVLink)."""
    n = len(sim.nic_names)
    if i < 2 * n:
        return f"{sim.nic_names[i % n]} {'egress' if i < n else 'ingress'}"
    i -= 2 * n
    return f"rank {i % sim.world} NVLink {'out' if i < sim.world else 'in'}"
