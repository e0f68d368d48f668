"""Bounds checks of one rank's plan, vectorised, before anything is registered or posted.

Every op must stay inside the regions it names: writes' src side inside this rank's
regions, dst side inside `peer_regions`; copies' strided boxes (element units of the op's
dtype) inside both regions. Batches must cover the writes exactly, stages and kinds must be
in range. Any violation raises `PlanBoundsError` naming the op and its values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from schemas.plan import (
    ACK,
    DONE,
    DTYPE_CODES,
    ITEMSIZE,
    PACK,
    QUANT,
    READY,
    STAGING,
    UNPACK,
    RankPlan,
    Table,
)

from .errors import PlanBoundsError

_MAX = 1 << 60  # any offset, size or stride beyond this is corrupt (and could overflow int64)
_MAX_STAGES = 1 << 24  # every rank walks every stage: more is a corrupt plan, not a schedule


def _fail(rp: RankPlan, table: str, bad: np.ndarray, why: str,
          row: Callable[[int], str]) -> None:
    rows = np.flatnonzero(bad)
    if len(rows):
        i = int(rows[0])
        raise PlanBoundsError(f"rank {rp.rank}: {table} op {i} {why} ({row(i)}); "
                              f"{len(rows)} {table} op(s) fail this check. The plan is corrupt "
                              "or was compiled for other tensors: recompile it")


def _row(t: Table) -> Callable[[int], str]:
    return lambda i: ", ".join(f"{n}={int(t[n][i])}" for n, _ in t.schema)


def check_rank_plan(rp: RankPlan) -> None:
    """Raise `PlanBoundsError` unless every op of `rp` is inside its regions."""
    sizes = np.array([r.nbytes for r in rp.regions] + [0], dtype=np.int64)
    nreg = len(rp.regions)
    for i, r in enumerate(rp.regions):
        if r.name == STAGING and (i != nreg - 1 or r.dtype != "uint8"):
            raise PlanBoundsError(f"rank {rp.rank}: the staging region must be the last region "
                                  f"and uint8; it is region {i} of {nreg}, {r.dtype}")
        if r.nbytes < 0:
            raise PlanBoundsError(f"rank {rp.rank}: region {i} ({r.name}) has {r.nbytes} bytes")
    if rp.stages < 0 or rp.stages > _MAX_STAGES:
        raise PlanBoundsError(f"rank {rp.rank}: stages is {rp.stages} (at most {_MAX_STAGES})")
    _check_writes(rp, sizes, nreg)
    _check_batches(rp)
    _check_copies(rp, sizes, nreg)
    for name, t in (("signal", rp.signals), ("wait", rp.waits)):
        row = _row(t)
        _fail(rp, name, (t["stage"] < 0) | (t["stage"] >= rp.stages), "has a stage out of "
              f"range [0, {rp.stages})", row)
        _fail(rp, name, ~np.isin(t["kind"], (DONE, ACK, READY)), "has an unknown kind", row)
        _fail(rp, name, (t["peer"] < 0) | (t["peer"] == rp.rank), "names an invalid peer", row)
    w = rp.waits
    _fail(rp, "wait", (w["kind"] == ACK) & (w["stage"] == 0),
          "waits for an ACK at stage 0 (ACKs of stage s-1 free stage s)", _row(w))


def _check_writes(rp: RankPlan, sizes: np.ndarray, nreg: int) -> None:
    w, row = rp.writes, _row(rp.writes)
    nbytes, so, do = w["nbytes"], w["src_offset"], w["dst_offset"]
    _fail(rp, "write", (nbytes < 0) | (nbytes > _MAX) | (so < 0) | (so > _MAX) | (do < 0)
          | (do > _MAX), "has a negative or huge offset or size", row)
    sr = w["src_region"]
    _fail(rp, "write", (sr < 0) | (sr >= nreg), f"names a src region outside [0, {nreg})", row)
    _fail(rp, "write", so + nbytes > sizes[np.clip(sr, 0, nreg)],
          "reads past the end of its local src region", row)
    peers = {p: dict(rs) for p, rs in rp.peer_regions}
    known = np.isin(w["dst_rank"], np.array(sorted(peers), dtype=np.int64))
    _fail(rp, "write", ~known, "writes to a rank missing from peer_regions", row)
    dr = w["dst_region"]
    for peer, psizes in peers.items():
        sel = w["dst_rank"] == peer
        if not sel.any():
            continue
        regs = np.array(sorted(psizes), dtype=np.int64)
        ps = np.array([psizes[r] for r in regs.tolist()] + [0], dtype=np.int64)
        at = np.minimum(np.searchsorted(regs, dr), len(regs))
        listed = (at < len(regs)) & (regs[np.minimum(at, len(regs) - 1)] == dr)
        _fail(rp, "write", sel & ~listed,
              f"names a dst region of rank {peer} that peer_regions does not list", row)
        _fail(rp, "write", sel & (do + nbytes > ps[np.where(listed, at, len(regs))]),
              f"writes past the end of its dst region on rank {peer}", row)


def _check_batches(rp: RankPlan) -> None:
    b, n = rp.batches, len(rp.writes)
    start, stop = b["start"], b["stop"]
    expected_start = np.concatenate([[0], stop[:-1]]).astype(np.int64)
    _fail(rp, "batch", (start != expected_start) | (stop < start), "does not start where the "
          "previous batch stops (batches must cover the writes in order)", _row(b))
    if (len(b) and int(stop[-1]) != n) or (not len(b) and n):
        raise PlanBoundsError(f"rank {rp.rank}: batches cover writes [0, "
                              f"{int(stop[-1]) if len(b) else 0}) but there are {n} writes")
    _fail(rp, "batch", (b["stage"] < 0) | (b["stage"] >= rp.stages),
          f"has a stage out of range [0, {rp.stages})", _row(b))
    _fail(rp, "batch", (b["nic"] < 0) | (b["nic"] >= max(1, len(rp.nics))),
          f"names a nic outside [0, {len(rp.nics)})", _row(b))


def _check_copies(rp: RankPlan, sizes: np.ndarray, nreg: int) -> None:
    c, row = rp.copies, _row(rp.copies)
    itemsize = np.array([ITEMSIZE[d] for d in DTYPE_CODES], dtype=np.int64)
    _fail(rp, "copy", ~np.isin(c["kind"], (PACK, UNPACK, QUANT)),
          "has a kind other than PACK/UNPACK/QUANT", row)
    quant = c["kind"] == QUANT
    _fail(rp, "copy", (c["stage"] < 0) | (c["stage"] >= rp.stages),
          f"has a stage out of range [0, {rp.stages})", row)
    box = [c[f"size{k}"] for k in range(3)]
    for side in ("src", "dst"):
        reg, code = c[f"{side}_region"], c[f"{side}_dtype"].astype(np.int64)
        _fail(rp, "copy", (reg < 0) | (reg >= nreg), f"names a {side} region outside [0, {nreg})",
              row)
        _fail(rp, "copy", code >= len(DTYPE_CODES), f"has an unknown {side} dtype code", row)
        strides = [c[f"{side}_stride{k}"] for k in range(3)]
        off = c[f"{side}_offset"]
        vals = [off, *strides, *box]
        _fail(rp, "copy", np.any([(v < 0) | (v > (1 << 31 if v is not off else _MAX))
                                  for v in vals], axis=0),
              f"has a negative or huge {side} offset, stride or size", row)
        empty = np.any([s == 0 for s in box], axis=0)
        last = off + sum((s - 1) * st for s, st in zip(box, strides))
        if side == "dst":  # QUANT writes its values contiguously
            last = np.where(quant, off + box[0] * box[1] - 1, last)
        numel = sizes[np.clip(reg, 0, nreg)] // itemsize[np.clip(code, 0, len(itemsize) - 1)]
        _fail(rp, "copy", ~empty & (last >= numel),
              f"reaches past the end of its {side} region (max element index >= numel)", row)
    _check_quant_scales(rp, sizes, nreg, quant)


def _check_quant_scales(rp: RankPlan, sizes: np.ndarray, nreg: int, quant: np.ndarray) -> None:
    c = rp.copies
    blocks = -(-c["size0"] // 128) * -(-c["size1"] // 128)
    aux, reg = c["aux_offset"], np.clip(c["dst_region"], 0, nreg)
    _fail(rp, "copy", quant & ((aux < 0) | (aux > _MAX) | ((aux + blocks) * 4 > sizes[reg])),
          "(QUANT) puts its scales past the end of its dst region", _row(c))
    _fail(rp, "copy", quant & (c["dst_dtype"] != DTYPE_CODES.index("float8_e4m3fn")),
          "(QUANT) has a dst dtype other than float8_e4m3fn", _row(c))


def check_against_header(rp: RankPlan, header: dict[str, Any]) -> None:
    """Raise `PlanBoundsError` unless `rp` agrees with its plan's header: the same stage
    count as every other rank (`header["stages"]`), and every rank it names inside the world
    (`header["world"]`). Either key may be absent (hand-built plans)."""
    stages, world = header.get("stages"), header.get("world")
    if isinstance(stages, int) and rp.stages != stages:
        raise PlanBoundsError(f"rank {rp.rank}: has {rp.stages} stage(s), the plan's header "
                              f"says {stages}; every rank must walk the same stages: the plan "
                              "is corrupt, recompile it")
    if not isinstance(world, int):
        return
    if not 0 <= rp.rank < world:
        raise PlanBoundsError(f"rank {rp.rank}: outside the plan's world of {world} ranks")
    for name, col in (("write", rp.writes["dst_rank"]), ("signal", rp.signals["peer"]),
                      ("wait", rp.waits["peer"]),
                      ("peer_regions", np.array([p for p, _ in rp.peer_regions], dtype=np.int64))):
        bad = np.flatnonzero((col < 0) | (col >= world))
        if len(bad):
            raise PlanBoundsError(f"rank {rp.rank}: {name} {int(bad[0])} names rank "
                                  f"{int(col[bad[0]])}, outside the plan's world of {world} ranks "
                                  f"({len(bad)} such); the plan is corrupt, recompile it")
