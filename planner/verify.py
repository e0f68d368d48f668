"""The plan's invariants, checked on the plan alone (`rdma-plan verify`, property tests).

One implementation serves the CLI and the property suite:
- `bounds`: every write, batch and copy inside its regions; dtypes and kinds valid;
- `coverage`: every logical byte of every target region is written exactly once per run
  (by a write or an unpack), nothing outside it, and no two writes overlap in a
  destination (staging: per stage);
- `roles`: each op writes only the memory its role may (`schemas/rankcheck.py`);
- `sizes`: no write above `max_write_bytes`, staging within `staging_bytes`;
- `staging_fit`: no rank's staging exceeds what its ops use at peak (the budget is a cap);
- `order`: the stage DAG is acyclic; every wait has its signal and vice versa; every
  (source, target, stage) with writes has READY and DONE; staged writes into a target's
  staging after stage 0 wait for its ACK of the stage before, or (slotted staging) touch no
  byte it still reads in the stages its SLOT_ACK does not cover;
- `dataflow`: staging is filled before it is read, in the same stage: every staging byte
  a write reads was packed by that rank in the write's stage (packs run before writes),
  every staging byte an unpack reads was written into it in the unpack's stage (writes
  land before DONE, unpacks run after it); packs of one stage never overlap; a stage
  that packs early (`schemas/protocol.py`) packs into no byte a peer writes in the
  previous stage;
- `balance`: where every source rank holds the whole model (pure data parallelism), the
  busiest source NIC sends at most the mean over source NICs plus one chunk
  (`planner/passes/assign.py`), in bytes of remote (non-NVLink) writes.
Each check returns violation messages; `verify_plan` gives them all, in that order.
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np

from planner.passes.lower import ALIGN
from schemas import rankcheck
from schemas.bounds import violations
from schemas.header import PlanHeader
from schemas.plan import (
    ACK,
    DONE,
    PACK,
    QUANT,
    READY,
    SLOT_ACK,
    UNPACK,
    Plan,
    PlanFormatError,
    RankPlan,
    load_plan,
)
from schemas.protocol import (
    ITEM,
    SCALE_BYTES,
    SLOTS,
    copy_extents,
    copy_footprint,
    overlaps,
    prepacked,
    quant_scales,
    sent_stage,
    staging_index,
    wait_stage,
    write_footprint,
    write_stages,
)

MAX_RUNS = 1 << 24
"""Contiguous runs of one copy's box that `copy_runs` lists (a compiled copy has at most a
box's rows)."""


def bounds(plan: Plan) -> list[str]:
    """The bounds proof (`schemas.bounds`, the executor's own load-time check) of every rank,
    against the regions its peers really have; and every rank's `peer_regions` (what its
    executor checks peers against at connect) equal to those regions."""
    out: list[str] = []
    world = len(plan.ranks)
    sizes = {rp.rank: {i: r.nbytes for i, r in enumerate(rp.regions)} for rp in plan.ranks}
    for rp in plan.ranks:
        msg = next(violations(rp, world, sizes), None)
        if msg is None:
            wrong = [(p, r) for p, regs in rp.peer_regions for r, n in regs
                     if sizes.get(p, {}).get(r) != n]
            if wrong:
                msg = (f"rank {rp.rank}: peer_regions gives rank {wrong[0][0]} region "
                       f"{wrong[0][1]} a size that rank does not have")
        if msg is not None:
            out.append(msg)
    return out


def copy_runs(c, i: int, side: str, es: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte intervals `[start, end)` that copy `i` of table `c` touches on one side
    (`es`: element size there), one per contiguous run of its strided box."""
    dims = [(int(c[f"size{d}"][i]), int(c[f"{side}_stride{d}"][i])) for d in range(3)]
    dims = [(n, st) for n, st in dims if n > 1]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    if math.prod(n for n, _ in dims) > MAX_RUNS:
        raise PlanFormatError(f"copy {i} is cut into {math.prod(n for n, _ in dims):,} runs, "
                              f"more than verify checks ({MAX_RUNS:,}); the plan is corrupt")
    start = np.array([int(c[f"{side}_offset"][i])], dtype=np.int64)
    for n, st in dims:
        start = (start[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
    return start * es, (start + run) * es


def _union(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted intervals covering the same bytes as `[lo, hi)`."""
    if len(lo) == 0:
        return lo, hi
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], np.maximum.accumulate(hi[order])
    new = np.ones(len(lo), dtype=bool)
    new[1:] = lo[1:] > hi[:-1]
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(lo)) - 1
    return lo[starts], hi[ends]


def _outside(lo: np.ndarray, hi: np.ndarray, w_lo: np.ndarray, w_hi: np.ndarray) -> np.ndarray:
    """Which read intervals `[lo, hi)` are not inside the written bytes `[w_lo, w_hi)`."""
    u_lo, u_hi = _union(w_lo, w_hi)
    k = np.searchsorted(u_lo, lo, side="right") - 1
    inside = (k >= 0) & (u_hi[np.maximum(k, 0)] >= hi) if len(u_lo) else np.zeros(len(lo), bool)
    return ~inside & (hi > lo)


def _copy_bytes(rp: RankPlan, kind: int, side: str, region: int
                ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """stage -> byte intervals that copies of `kind` touch in `region` on `side`."""
    c = rp.copies
    acc: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for i in np.flatnonzero((c["kind"] == kind) & (c[f"{side}_region"] == region)).tolist():
        es = int(ITEM[c[f"{side}_dtype"][i]])
        acc.setdefault(int(c["stage"][i]), []).append(copy_runs(c, i, side, es))
    return {s: (np.concatenate([p[0] for p in v]), np.concatenate([p[1] for p in v]))
            for s, v in acc.items()}


def _quant_bytes(rp: RankPlan, region: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """stage -> byte intervals QUANT copies write in `region`: each row of their e4m3 box
    and of their scales (`schemas.protocol.quant_scales`)."""
    c = rp.copies
    rows = np.flatnonzero((c["kind"] == QUANT) & (c["dst_region"] == region))
    a, rb, cb, st = quant_scales(rp, rows)
    m, n = c["size0"][rows].astype(np.int64), c["size1"][rows].astype(np.int64)
    if int(m.sum() + rb.sum()) > MAX_RUNS:
        raise PlanFormatError(f"rank {rp.rank}: its QUANTs write over {MAX_RUNS:,} rows; the "
                              "plan is corrupt")
    acc: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for j, i in enumerate(rows.tolist()):
        e4m3 = int(c["dst_offset"][i]) + np.arange(m[j], dtype=np.int64) * int(c["dst_stride0"][i])
        scale = (a[j] + np.arange(rb[j], dtype=np.int64) * st[j]) * SCALE_BYTES
        acc.setdefault(int(c["stage"][i]), []).append(
            (np.concatenate([e4m3, scale]),
             np.concatenate([e4m3 + n[j], scale + cb[j] * SCALE_BYTES])))
    return {s: _cat(*v) for s, v in acc.items()}


def _cat(*parts: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return (np.concatenate([np.zeros(0, np.int64), *(p[0] for p in parts)]).astype(np.int64),
            np.concatenate([np.zeros(0, np.int64), *(p[1] for p in parts)]).astype(np.int64))


def dataflow(plan: Plan) -> list[str]:
    """Staging a write reads holds data: filled by this stage's packs or QUANTs, or by the
    previous stage's packs and landed writes (a gather: its DONE is awaited first)."""
    out: list[str] = []
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    landed: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
    for rp in plan.ranks:
        w, stage = rp.writes, write_stages(rp)
        for peer in np.unique(w["dst_rank"]).tolist():
            sg = staging_index(plan.ranks[peer])
            m = (w["dst_rank"] == peer) & (w["dst_region"] == sg)
            for s in np.unique(stage[m]).tolist():
                sel = m & (stage == s)
                lo = w["dst_offset"][sel].astype(np.int64)
                landed.setdefault((peer, s), []).append((lo, lo + w["nbytes"][sel]))
    for rp in plan.ranks:
        w, stage = rp.writes, write_stages(rp)
        sg = staging_index(rp)
        if sg < 0:
            continue
        packed = _copy_bytes(rp, PACK, "dst", sg)
        for s, (lo, hi) in packed.items():
            order_ = np.argsort(lo, kind="stable")
            if len(lo) > 1 and (lo[order_][1:] < hi[order_][:-1]).any():
                out.append(f"rank {rp.rank}: packs of stage {s} overlap in staging")
        quant = _quant_bytes(rp, sg)
        m = w["src_region"] == sg
        for s in np.unique(stage[m]).tolist():
            sel = np.flatnonzero(m & (stage == s))
            lo = w["src_offset"][sel].astype(np.int64)
            filled = _cat(packed.get(s, empty), quant.get(s, empty), packed.get(s - 1, empty),
                          *landed.get((rp.rank, s - 1), []))
            bad = _outside(lo, lo + w["nbytes"][sel], *filled)
            if bad.any():
                out.append(f"rank {rp.rank}: write {int(sel[np.argmax(bad)])} (stage {s}) "
                           "reads staging bytes that no pack of its stage fills")
    for rp in plan.ranks:  # a prepacked stage packs while peers' writes may still land
        sg = staging_index(rp)
        for s in np.flatnonzero(prepacked(rp)).tolist():
            mine = np.flatnonzero(np.isin(rp.copies["kind"], (PACK, QUANT))
                                  & (rp.copies["stage"] == s))
            if overlaps(copy_extents(rp, "dst", mine), _cat(*landed.get((rp.rank, s - 1), []))):
                out.append(f"rank {rp.rank}: stage {s} packs early (schemas/protocol.py) into "
                           f"staging bytes that writes of stage {s - 1} land in")
    for rp in plan.ranks:
        sg = staging_index(rp)
        if sg < 0:
            continue
        for s, (lo, hi) in sorted(_copy_bytes(rp, UNPACK, "src", sg).items()):
            parts = landed.get((rp.rank, s), [])
            w_lo = np.concatenate([p[0] for p in parts]) if parts else empty[0]
            w_hi = np.concatenate([p[1] for p in parts]) if parts else empty[1]
            if _outside(lo, hi, w_lo, w_hi).any():
                out.append(f"rank {rp.rank}: an unpack of stage {s} reads staging bytes that "
                           "no write of its stage fills")
    return out[:5]


def nic_egress(plan: Plan) -> dict[str, int]:
    """Bytes each source NIC sends per run (remote writes; NVLink batches excluded)."""
    out: dict[str, int] = {}
    for rp in plan.ranks:
        if rp.role != "source" or not rp.nics:
            continue
        b = rp.batches
        sent = 0
        for i in np.flatnonzero(b["nic"] == 0).tolist():
            sent += int(rp.writes["nbytes"][b["start"][i]:b["stop"][i]].sum())
        out[rp.nics[0]] = out.get(rp.nics[0], 0) + sent
    return out


def fully_replicated(header: PlanHeader) -> bool:
    """Whether every source rank holds the whole model (the compiler stores it)."""
    return header.source_replicated


def balance(plan: Plan, replicated: bool | None = None) -> list[str]:
    """The per-NIC balance bound of `assign` where it is promised (see module docstring).

    A chunk is at most `max_write_bytes` (or one row of its target box, where a row is
    longer: `split_rows` never cuts a row); a box that takes the gather pass goes to its
    least-loaded owner as one unit of its whole fan-out (`stats.gather_unit_max`). The
    slack allowed is the larger unit."""
    if not (fully_replicated(plan.header) if replicated is None else replicated):
        return []
    egress = nic_egress(plan)
    if len(egress) < 2:
        return []
    slack = max(plan.header.options.max_write_bytes, plan.header.model.longest_row_bytes,
                plan.header.stats.gather_unit_max)
    mean = sum(egress.values()) / len(egress)
    name, most = max(egress.items(), key=lambda kv: kv[1])
    if most > mean + slack:
        return [f"NIC {name} sends {most} bytes, more than the mean {mean:.0f} over "
                f"{len(egress)} source NICs plus one unit ({slack} bytes)"]
    return []


def _intervals(plan: Plan) -> dict[tuple[int, int, int], list[tuple[np.ndarray, np.ndarray]]]:
    """(dst rank, region, stage or -1) -> list of (start, end) byte arrays written there."""
    acc: dict[tuple[int, int, int], list] = {}
    for rp in plan.ranks:
        w, stage = rp.writes, write_stages(rp)
        for peer in np.unique(w["dst_rank"]).tolist():
            m = w["dst_rank"] == peer
            staging = staging_index(plan.ranks[peer])
            is_staging = staging >= 0
            for reg in np.unique(w["dst_region"][m]).tolist():
                mm = m & (w["dst_region"] == reg)
                st = stage[mm] if is_staging and reg == staging else np.full(mm.sum(), -1)
                for s in np.unique(st).tolist():
                    sel = np.nonzero(mm)[0][st == s]
                    acc.setdefault((peer, reg, s), []).append(
                        (w["dst_offset"][sel], w["dst_offset"][sel] + w["nbytes"][sel]))
        c = rp.copies
        for i in np.nonzero(c["kind"] == UNPACK)[0].tolist():
            acc.setdefault((rp.rank, int(c["dst_region"][i]), -1), []).append(
                copy_runs(c, i, "dst", int(ITEM[c["dst_dtype"][i]])))
    return acc


def coverage(plan: Plan) -> list[str]:
    out = []
    written: dict[tuple[int, int], int] = {}
    for (rank, reg, stage), parts in sorted(_intervals(plan).items()):
        lo = np.concatenate([p[0] for p in parts])
        hi = np.concatenate([p[1] for p in parts])
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        if len(lo) > 1 and (lo[1:] < hi[:-1]).any():
            i = int(np.argmax(lo[1:] < hi[:-1]))
            name = plan.ranks[rank].regions[reg].name
            out.append(f"rank {rank} {name}: writes overlap at byte {lo[i + 1]}"
                       + (f" in stage {stage}" if stage >= 0 else ""))
        if stage == -1:
            written[(rank, reg)] = int((hi - lo).sum())
    cov = plan.coverage
    for rank, reg, nbytes in zip(cov["rank"].tolist(), cov["region"].tolist(),
                                 cov["nbytes"].tolist()):
        if not (0 <= rank < len(plan.ranks) and 0 <= reg < len(plan.ranks[rank].regions)):
            out.append(f"coverage names region {reg} of rank {rank}, which does not exist")
            continue
        got = written.get((rank, reg), 0)
        if got != nbytes:
            name = plan.ranks[rank].regions[reg].name
            out.append(f"rank {rank} {name}: {got} bytes written per run, but it holds "
                       f"{nbytes} logical bytes")
    return out


def sizes(plan: Plan) -> list[str]:
    opts = plan.header.options
    return [m for rp in plan.ranks
            for m in rankcheck.sizes(rp, opts.max_write_bytes, opts.staging_bytes)]


def roles(plan: Plan) -> list[str]:
    """Each op writes only what its role may (`schemas.rankcheck.roles`, exact here: every
    rank's role and staging index are known)."""
    kinds = [rp.role for rp in plan.ranks]
    staging = {rp.rank: staging_index(rp) for rp in plan.ranks}
    return [m for rp in plan.ranks for m in rankcheck.roles(rp, kinds, staging)][:5]


def staging_use(plan: Plan) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per rank with staging: (stage, lo, hi) of every staging byte interval its ops touch:
    its writes' sources, peers' writes into it, and both sides of its copies."""
    acc: dict[int, list[tuple[np.ndarray, ...]]] = {}
    peer_sg = np.array([staging_index(p) for p in plan.ranks], dtype=np.int64)
    for rp in plan.ranks:
        sg, stage = staging_index(rp), write_stages(rp)
        reg, lo, hi = write_footprint(rp, "src")
        acc.setdefault(rp.rank, []).append((stage[reg == sg], lo[reg == sg], hi[reg == sg]))
        reg, lo, hi = write_footprint(rp, "dst")
        into = reg == peer_sg[rp.writes["dst_rank"]]
        for peer in np.unique(rp.writes["dst_rank"][into]).tolist():
            m = into & (rp.writes["dst_rank"] == peer)
            acc.setdefault(peer, []).append((stage[m], lo[m], hi[m]))
        for side in ("src", "dst"):
            rows, reg, lo, hi = copy_footprint(rp, side)
            m = reg == sg
            acc[rp.rank].append((rp.copies["stage"][rows[m]].astype(np.int64), lo[m], hi[m]))
    return {r: tuple(np.concatenate([p[i] for p in parts]).astype(np.int64) for i in range(3))
            for r, parts in acc.items() if staging_index(plan.ranks[r]) >= 0}


def staging_fit(plan: Plan) -> list[str]:
    """No rank's staging exceeds what its ops use at peak: it ends at the last staging byte
    they touch (rounded up to `ALIGN`), and it is at most the bytes the `SLOTS` stages
    that use the most touch (a stage's use: from its first to its last byte; the rotation
    keeps up to `SLOTS` stages' staging live at once), plus `ALIGN` per slot."""
    out = []
    for r, (stage, lo, hi) in staging_use(plan).items():
        have = plan.ranks[r].regions[-1].nbytes
        keep = hi > lo
        stage, lo, hi = stage[keep], lo[keep], hi[keep]
        end = -(-int(hi.max(initial=0)) // ALIGN) * ALIGN
        first = np.full(int(stage.max(initial=-1)) + 1, np.iinfo(np.int64).max)
        last = np.zeros(len(first), dtype=np.int64)
        np.minimum.at(first, stage, lo)
        np.maximum.at(last, stage, hi)
        span = np.sort(np.where(last > 0, last - first, 0))[::-1]
        peak = int(span[:SLOTS].sum()) + SLOTS * ALIGN
        if have > min(end, peak):
            out.append(f"rank {r}: staging of {have} bytes exceeds what its ops use at peak "
                       f"(they touch bytes up to {end}; its {SLOTS} busiest stages "
                       f"{peak - SLOTS * ALIGN})")
    return out


def order(plan: Plan) -> list[str]:
    out = []
    g = nx.DiGraph()
    g.add_nodes_from(range(len(plan.dag_nodes)))
    g.add_edges_from(zip(plan.dag_edges["u"].tolist(), plan.dag_edges["v"].tolist()))
    if not nx.is_directed_acyclic_graph(g):
        out.append("the stage DAG has a cycle")
    sent = {(rp.rank, int(s), int(p), int(k)) for rp in plan.ranks
            for s, p, k in zip(rp.signals["stage"], rp.signals["peer"], rp.signals["kind"])}
    waited = {(rp.rank, int(s), int(p), int(k)) for rp in plan.ranks
              for s, p, k in zip(rp.waits["stage"], rp.waits["peer"], rp.waits["kind"])}
    for r, s, p, k in sorted(waited):
        if (p, sent_stage(k, s), r, k) not in sent:
            out.append(f"rank {r} waits for signal kind {k} from rank {p} in stage {s}, "
                       "which is never sent")
    for r, s, p, k in sorted(sent):
        if (p, wait_stage(k, s), r, k) not in waited:
            out.append(f"rank {r} sends signal kind {k} to rank {p} in stage {s}, which "
                       "nobody waits for")
    for rp in plan.ranks:
        stage = write_stages(rp)
        pairs = set(zip(stage.tolist(), rp.writes["dst_rank"].tolist()))
        for s, p in sorted(pairs):
            if (rp.rank, s, p, DONE) not in sent or (p, 0, rp.rank, READY) not in sent:
                out.append(f"rank {rp.rank} writes to rank {p} in stage {s} without READY "
                           "and DONE signals")
            staging = staging_index(plan.ranks[p])
            into = (rp.writes["dst_rank"] == p) & (rp.writes["dst_region"] == staging) & \
                (stage == s)
            if not (s > 0 and staging >= 0 and into.any()) or (rp.rank, s, p, ACK) in waited:
                continue
            freed = s - SLOTS if (rp.rank, s, p, SLOT_ACK) in waited else -1
            lo, hi = write_footprint(rp, "dst")[1:]
            if overlaps((lo[into], hi[into]), _staging_reads(plan.ranks[p], freed + 1, s)):
                out.append(f"rank {rp.rank} writes into rank {p}'s staging in stage {s} "
                           f"bytes that rank {p} may still read in stages {freed + 1}..{s - 1}"
                           " (it waits for no ACK of stage s-1)")
    return out[:5]


def _staging_reads(rp: RankPlan, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Staging bytes rank `rp` reads in stages `first` .. `stop - 1`: the sources of its
    writes and copies (what a SLOT_ACK of stage `first - 1` does not yet free)."""
    sg = staging_index(rp)
    w, c = rp.writes, rp.copies
    st = write_stages(rp)
    mw = (w["src_region"] == sg) & (st >= first) & (st < stop)
    mc = np.flatnonzero((c["src_region"] == sg) & (c["stage"] >= first) & (c["stage"] < stop))
    _, lo, hi = write_footprint(rp, "src")
    c_lo, c_hi = copy_extents(rp, "src", mc)
    return np.concatenate([lo[mw], c_lo]), np.concatenate([hi[mw], c_hi])


def verify_plan(plan: Plan) -> list[str]:
    """All violations, in check order (bounds first: later checks assume them)."""
    problems = bounds(plan)
    if problems:
        return problems
    return roles(plan) + coverage(plan) + sizes(plan) + staging_fit(plan) + order(plan) \
        + dataflow(plan) + balance(plan)


def verify_file(path: str) -> list[str]:
    return verify_plan(load_plan(path))
