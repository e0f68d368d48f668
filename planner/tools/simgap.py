"""Why a simulated plan is slower than its floor, and the lines `rdma-plan simulate` prints
(`summary_text`).

The floor is the busiest resource (a NIC direction, or a rank's NVLink direction) moving
its bytes at full rate; the estimate exceeds it by the time that resource is idle before
the transfer ends plus the time it is busy below its full rate. `explain_gap` splits it
by where it falls on the busiest resource's timeline:

- **head**: before its first batch starts (waits for READY, stage 0's packs);
- **stage boundaries**: between a batch of stage s and the next batch, of a later stage,
  on it (the protocol's DONE -> unpack -> ACK round trip, or packs, between stages);
- **within stages**: between batches of one stage (the write window ran dry: the sources
  feeding it were busy elsewhere, or waited for their own packs);
  Of it, the time the batch after the idle waited for its source's packs (or QUANTs) of
  its stage that could not run early (`boundary_packs`: staging bytes the previous stages
  still read) is named apart, with the option that lets them run early;
- **tail**: after its last batch lands, until the last rank finishes (another resource's
  late batches, or unpacks);
- **per-write costs**: link time it spends on batch latency and per-write costs (an RDMA
  work request, an NVLink peer copy's fixed cost), as the simulator charges them;
- **shared below its rate**: the rest of the time it is busy but moves less than its rate
  (its flows share their other end with other flows);
- **coarse model** (only where `simulate` ran its coarse model; signed): the time its
  flows' shares idled because a flow that had ended waited for its group to land, less the
  time of the bytes skipped where a group landed before a flow's last bytes (the model's
  own error, out of "shared below its rate"; the exact model has none).

It names the largest cause with its stage, the batch and tensor behind the tail, and the
option that changes it. Inputs are the simulation's own columns (`planner/tools/simulate.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.tools.simflow import resource_name
from schemas.plan import RankPlan


def explain_gap(sim: Any, res: dict[str, Any]) -> dict[str, Any]:
    """The gap between `res`'s estimate and floor (on its bottleneck resource), split by
    cause (seconds), with the largest cause, the tail's batch and tensor, and a
    suggestion."""
    est, worst = res["estimated_s"], res["bottleneck_index"]
    on = np.flatnonzero((sim.eres == worst) | (sim.ires == worst))
    out: dict[str, Any] = {"resource": resource_name(sim, worst), "gap_s": est - res["floor_s"]}
    if est <= 0 or len(on) == 0:
        return out | {"busy_fraction": 0.0, "causes": {}, "largest": None, "suggest": ""}
    start, end, stage = sim.start[on], sim.end[on], sim.b.stage[on]
    order = np.argsort(start, kind="stable")
    start, end, stage = start[order], end[order], stage[order]
    reach = np.maximum.accumulate(end)  # how far the resource is busy, batch by batch
    idle = np.maximum(start[1:] - reach[:-1], 0.0)
    last_stage = stage[np.maximum.accumulate(np.where(end == reach, np.arange(len(end)), 0))]
    boundary = stage[1:] != last_stage[:-1]
    by_stage: dict[int, float] = {}
    for s, gap in zip(last_stage[:-1][boundary].tolist(), idle[boundary].tolist()):
        by_stage[s] = by_stage.get(s, 0.0) + gap
    busy = float(res_busy(res, sim, worst))
    # link time of batch latency and per-write costs (`simulate`: a batch's size beyond its
    # bytes) on this resource; the rest of its below-rate time is sharing
    costs = float(((sim.size[on] - sim.b.nbytes[on]) / sim.cap[worst]).sum())
    below = max(busy - res["floor_s"], 0.0)
    costs = min(costs, below)
    coarse = {}  # the coarse model's own slack (`simulate`): shares idle until a group
    # lands, less the bytes skipped where it lands early (signed)
    if res.get("model") == "coarse":
        coarse = {"coarse model": min(float(sim.slack[worst] / sim.cap[worst]), below - costs)}
    causes = {"per-write costs": costs,
              "shared below its rate": below - costs - sum(coarse.values()), **coarse,
              "head": float(start[0]), "stage boundaries": float(idle[boundary].sum()),
              "within stages": float(idle[~boundary].sum()),
              "tail": float(max(est - reach[-1], 0.0))}
    largest = max(causes, key=causes.get)
    out |= {"busy_fraction": busy / est, "causes": causes, "largest": largest,
            "worst_boundary": (max(by_stage, key=by_stage.get) if by_stage else None),
            "boundary_packs": _boundary_packs(sim, on[order][1:][boundary], reach[:-1][boundary],
                                              start[1:][boundary]),
            "tail": _tail(sim, res)}
    out["suggest"] = _suggest(sim, out)
    return out


def _boundary_packs(sim: Any, after: np.ndarray, idle_from: np.ndarray, idle_to: np.ndarray
                    ) -> dict[str, Any]:
    """Of the idle time at stage boundaries (`idle_from` -> `idle_to`, each ended by batch
    `after`), the part during which that batch's source ran the packs (or QUANTs) of its
    stage that did not run early (`sim.packing`): the time the resource waited for them.
    With the ranks, their largest such stage's pack seconds and their staging bytes."""
    packing = getattr(sim, "packing", {})
    total, ranks, longest = 0.0, set(), 0.0
    for g, a, z in zip(after.tolist(), idle_from.tolist(), idle_to.tolist()):
        r, s = int(sim.b.rank[g]), int(sim.b.stage[g])
        p = packing.get((r, s))
        if p is None or z <= a:
            continue
        wait = min(z, p[1]) - max(a, p[0])
        if wait > 0:
            total += wait
            ranks.add(r)
            longest = max(longest, p[1] - p[0])
    stats = sim.header.rank_stats
    staging = max((stats[r].staging for r in ranks if r < len(stats)), default=0)
    return {"seconds": total, "ranks": sorted(ranks), "longest_s": longest,
            "staging_bytes": staging}


def res_busy(res: dict[str, Any], sim: Any, worst: int) -> float:
    n = len(sim.nic_names)
    if worst < 2 * n:
        nic = res["nics"][worst % n]
        return nic["busy_out_s"] if worst < n else nic["busy_in_s"]
    on = (sim.eres == worst) | (sim.ires == worst)
    spans = np.stack([sim.start[on], sim.end[on]], axis=1)
    spans = spans[np.argsort(spans[:, 0])]
    total, reach = 0.0, -np.inf
    for a, b in spans.tolist():
        total += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return total


def _tail(sim: Any, res: dict[str, Any]) -> dict[str, Any]:
    """The rank that finishes last, its last landed batch and the tensor it writes most."""
    finish = np.asarray(res["rank_finish_s"])
    r = int(np.argmax(finish))
    mine = np.flatnonzero((sim.b.rank == r) | (sim.b.dst == r))
    out: dict[str, Any] = {"rank": r, "finish_s": float(finish[r])}
    if len(mine) == 0:
        return out
    g = int(mine[np.argmax(sim.end[mine])])
    src = int(sim.b.rank[g])
    first = int(np.searchsorted(sim.b.rank, src))  # batches are in (rank, plan order)
    rp = sim.src.rank(src)  # the two ranks it names, read again (`planner.tools.planfile`)
    lo, hi = int(rp.batches["start"][g - first]), int(rp.batches["stop"][g - first])
    dst = int(sim.b.dst[g])
    w = rp.writes
    regions = w["dst_region"][lo:hi]
    weight = np.bincount(regions, weights=w["nbytes"][lo:hi].astype(np.float64))
    target = sim.src.rank(dst)
    names = [reg.name for reg in target.regions]
    top = int(np.argmax(weight)) if len(weight) else -1
    tensor = names[top] if 0 <= top < len(names) else None
    if tensor is not None and tensor.startswith("__"):  # staging: where its unpacks go
        tensor = _unpacked_into(target, top, int(sim.b.stage[g])) or tensor
    return out | {"batch": {"source": src, "target": dst, "stage": int(sim.b.stage[g]),
                            "bytes": int(sim.b.nbytes[g]), "writes": hi - lo,
                            "start_s": float(sim.start[g]), "end_s": float(sim.end[g]),
                            "egress": resource_name(sim, int(sim.eres[g])),
                            "ingress": resource_name(sim, int(sim.ires[g]))},
                  "tensor": tensor,
                  "after_last_write_s": float(finish[r] - sim.end[g])}


def _unpacked_into(rp: RankPlan, staging: int, stage: int) -> str | None:
    """The tensor that most of a stage's unpacks from region `staging` write."""
    from schemas.plan import UNPACK

    c = rp.copies
    m = (c["kind"] == UNPACK) & (c["stage"] == stage) & (c["src_region"] == staging)
    if not m.any():
        return None
    n = (c["size0"][m] * c["size1"][m] * c["size2"][m]).astype(np.float64)
    return rp.regions[int(np.argmax(np.bincount(c["dst_region"][m], weights=n)))].name


def _suggest(sim: Any, g: dict[str, Any]) -> str:
    opts, stages = sim.header.options, max(sim.stages, default=0)
    largest, tail = g["largest"], g.get("tail", {})
    packs = g.get("boundary_packs") or {}
    if largest == "stage boundaries" and packs.get("seconds", 0.0) \
            >= 0.5 * g["causes"]["stage boundaries"]:
        return (f"{packs['seconds'] * 1e3:.2f} of the {g['causes']['stage boundaries'] * 1e3:.2f}"
                f" ms at stage boundaries {g['resource']} waits for the packs or QUANTs (an "
                f"FP8 gather's rounds) of source rank(s) {_ranks(packs['ranks'])}, which run "
                f"after the previous stage's writes (up to {packs['longest_s'] * 1e3:.2f} ms a "
                "stage), not beside them: they pack into staging bytes that the previous "
                f"stages still read ({_size(packs['staging_bytes'])} of staging on those "
                f"ranks). Raise options.staging_bytes (now {_size(opts.staging_bytes)}; "
                f"twice those ranks' staging is {_size(2 * packs['staging_bytes'])}) so that "
                "a stage's packs fit beside what the previous ones read (they then run "
                "during their writes: schemas/protocol.py's early packs)")
    if largest == "stage boundaries" and stages > 1:
        return (f"{stages} stages: raise options.staging_bytes (now {opts.staging_bytes >> 20} "
                "MiB) so that fewer, larger stages meet fewer DONE/ACK round trips (it caps "
                "every rank; targets stage only what keeps the write window full: "
                "`rdma-plan inspect` says each rank's)")
    if largest == "within stages":
        return ("the write window runs dry between batches: more batches in flight "
                "(executor max_inflight; `rdma-plan simulate --inflight N` shows it), or "
                "smaller options.max_write_bytes so that more sources feed this resource")
    if largest == "per-write costs":
        return (f"{g['resource']} spends {g['causes']['per-write costs'] * 1e3:.2f} ms on "
                "per-write and per-batch costs: fewer, "
                "larger writes (larger contiguous pieces, or a gather first)")
    if largest == "shared below its rate":
        return (f"{g['resource']} is busy but shared below its rate: its flows' other ends "
                "(a target's ingress, a source's egress) carry other flows at the same time; "
                "`rdma-plan inspect` shows the per-NIC balance")
    if largest == "head":
        return ("the first batch waits for stage 0's packs or READY: fewer bytes packed in "
                "stage 0 (direct writes go first) or a higher pack rate")
    if tail.get("after_last_write_s", 0.0) > 0.5 * g["causes"]["tail"] > 0:
        return (f"rank {tail['rank']} finishes {tail['after_last_write_s'] * 1e3:.2f} ms after "
                "its last write lands (unpacks, ACKs): fewer bytes through staging into it")
    b = tail.get("batch")
    if b and stages > 2:
        return (f"the transfer ends with stage {b['stage']}'s writes on {b['egress']} -> "
                f"{b['ingress']}, after {g['resource']} went idle; with {stages} stages each "
                "waits for the ACKs of the one before: raise options.staging_bytes (now "
                f"{opts.staging_bytes >> 20} MiB) for fewer stages, or lower "
                f"options.max_write_bytes (now {opts.max_write_bytes >> 20} MiB) for smaller "
                "last batches")
    if b:
        return (f"the last batch ({b['bytes'] / 1e6:.1f} MB, {b['egress']} -> {b['ingress']}) "
                f"lands after {g['resource']} went idle: lower options.max_write_bytes (now "
                f"{opts.max_write_bytes >> 20} MiB) spreads such batches over the transfer")
    return ""


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _ranks(ranks: list[int], limit: int = 8) -> str:
    return ", ".join(map(str, ranks[:limit])) + (f", ... ({len(ranks)} in all)"
                                                  if len(ranks) > limit else "")


def gap_text(g: dict[str, Any]) -> str:
    """The lines `rdma-plan simulate` adds under its summary."""
    if not g.get("causes") or g["gap_s"] <= 0:
        return ""
    c = g["causes"]
    parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in c.items()
                      if v > 0 or (k == "coarse model" and v))
    lines = [f"gap {g['gap_s'] * 1e3:.2f} ms: {g['resource']} busy "
             f"{g['busy_fraction'] * 100:.0f}% of the transfer; made of: {parts}"]
    if g["largest"] == "stage boundaries" and g.get("worst_boundary") is not None:
        lines.append(f"largest: stage boundaries, most after stage {g['worst_boundary']}")
    t = g.get("tail", {})
    if t.get("batch"):
        b = t["batch"]
        lines.append(f"tail: rank {t['rank']} finishes at {t['finish_s'] * 1e3:.2f} ms; its "
                     f"last batch: rank {b['source']} -> {b['target']}, stage {b['stage']}, "
                     f"{b['bytes'] / 1e6:.2f} MB in {b['writes']} writes ({t['tensor']}), "
                     f"{b['egress']} -> {b['ingress']}, lands at {b['end_s'] * 1e3:.2f} ms")
    if g.get("suggest"):
        lines.append(f"suggest: {g['suggest']}")
    return "\n".join(lines)


def model_text(res: dict[str, Any]) -> str:
    """The line that says the estimate is the coarse model's, how far it may be off, and how
    to get the exact one."""
    from planner.tools.simflow import COARSE_STATED

    return (f"coarse model ({res['batches']:,} batches): landings within "
            f"{res['quantum_s'] * 1e6:.1f} us of the first land together at their mean; within "
            f"{COARSE_STATED:.1%} of the exact model's estimate on every shipped plan both ran; "
            "--exact runs the exact one (an event per landing)")


def summary_text(res: dict[str, Any]) -> str:
    """Three lines a person reads: estimated time, floor, ratio and the bottleneck; then
    what the gap to the floor is made of (`gap_text`)."""
    return "\n".join([
        f"estimated {res['estimated_s'] * 1e3:.1f} ms  floor {res['floor_s'] * 1e3:.1f} ms  "
        f"ratio {res['ratio']:.3f}",
        f"bottleneck {res['bottleneck']}; {res['bytes'] / 1e9:.3f} GB in {res['batches']:,} "
        f"batches ({res['writes']:,} writes), {res['stages']} stages",
        f"simulated {res['events']:,} events in {res['sim_seconds']:.2f} s",
    ] + ([model_text(res)] if res.get("model") == "coarse" else [])
      + ([gap_text(res["gap"])] if gap_text(res.get("gap", {})) else []))
