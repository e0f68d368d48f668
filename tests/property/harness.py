"""Compile a case, run it in-process with label tensors, and count bytes written.

Labels: every logical element gets a value that names it. With float32 everywhere the
label is `1 + (global flat index)`, unique and < 2^24 (exact in float32). Where a side
is bfloat16 or float16, labels are drawn from the positive finite values that every dtype
in use represents exactly, so a cast keeps them; they repeat only every ~30k elements.
Target tensors start filled with `SENTINEL` (no label has it): after a run, an element a
piece covers must hold its own label and every padding element must still be `SENTINEL`.

`write_counts` re-reads the plan's writes and unpacks in plain numpy, without
`planner.tools.verify`, and counts how often each target byte is written per run.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
from hypothesis import assume

import executor
from harness.weights import DTYPES, materialize
from planner.compiler import compile_layouts
from schemas.config import ConfigError
from schemas.plan import ITEMSIZE, STAGING, UNPACK, Plan
from schemas.plan_write import write_plan
from tests.property.strategies import Case

SENTINEL = -1.0


def compile_case(case: Case) -> Plan:
    """The plan of `case`; a case whose staging budget is below one staged chunk is
    rejected by the compiler with a clear ConfigError and discarded here."""
    try:
        return compile_layouts(case.cfg, case.spec, case.src, case.dst)
    except ConfigError as e:
        assume("options.staging_bytes" not in str(e))
        raise


def dtypes_in_use(case: Case) -> set[str]:
    return {pt.dtype for lay in (case.src, case.dst) for rl in lay.ranks for pt in rl.tensors}


def label_values(dtypes: set[str]) -> torch.Tensor | None:
    """Positive finite values exact in every dtype of `dtypes` (None: float32 only)."""
    narrow = [d for d in ("bfloat16", "float16") if d in dtypes]
    if not narrow:
        return None
    bits = torch.arange(1, 0x7C00 if narrow[0] == "float16" else 0x7F80, dtype=torch.int32)
    vals = bits.to(torch.int16).view(DTYPES[narrow[0]]).float()
    for d in dtypes - {"float8_e4m3fn"}:  # FP8 targets quantize: no label survives
        vals = vals[vals.to(DTYPES[d]).float() == vals]
    return vals


def labels(case: Case) -> dict[str, torch.Tensor]:
    """Full logical tensors (float32) whose elements name themselves."""
    table = label_values(dtypes_in_use(case))
    out, base = {}, 0
    for t in case.spec.tensors:
        idx = torch.arange(base, base + t.numel, dtype=torch.int64)
        base += t.numel
        vals = (idx + 1).float() if table is None else table[idx % len(table)]
        out[t.name] = vals.reshape(t.shape)
    assert base < (1 << 24), "model too large for unique float32 labels"
    return out


def filled(case: Case, value: float) -> dict[int, dict[str, torch.Tensor]]:
    """Target tensors (plan ranks) filled with `value` everywhere, padding included."""
    n_src = case.src.world
    return {n_src + rl.rank: {pt.name: torch.full(pt.shape, value, dtype=DTYPES[pt.dtype])
                              for pt in rl.tensors} for rl in case.dst.ranks}


def run(plan: Plan, case: Case, full: dict[str, torch.Tensor], steps: int = 1
        ) -> dict[int, dict[str, torch.Tensor]]:
    """Run every rank of `plan` in-process: sources materialized from `full`, targets start
    at `SENTINEL`. Returns the target tensors after `steps` runs, by plan rank."""
    tensors = materialize(case.src, full)
    targets = filled(case, SENTINEL)
    tensors.update(targets)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.rplan")
        write_plan(path, plan)
        executor.run_all_local(path, tensors, steps=steps)
    return targets


def expected(case: Case, full: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """What every target tensor must hold: its pieces from `full`, `SENTINEL` elsewhere."""
    n_src = case.src.world
    want = materialize(case.dst, full)
    mask = materialize(case.dst, {k: torch.ones_like(v) for k, v in full.items()})
    return {n_src + r: {name: torch.where(mask[r][name] != 0, t,
                                          torch.full_like(t, SENTINEL))
                        for name, t in tensors.items()} for r, tensors in want.items()}


def mismatches(got: dict[int, dict[str, torch.Tensor]],
               want: dict[int, dict[str, torch.Tensor]], limit: int = 5) -> list[str]:
    out = []
    for r, tensors in want.items():
        for name, w in tensors.items():
            g = got[r][name]
            if g.dtype != w.dtype or not torch.equal(g.reshape(-1).view(torch.uint8),
                                                     w.reshape(-1).view(torch.uint8)):
                flat = (g != w).reshape(-1).nonzero()
                i = int(flat[0]) if len(flat) else 0
                out.append(f"rank {r} {name}: {int((g != w).sum())} elements differ, first "
                           f"flat index {i}: got {g.reshape(-1)[i].item()} want "
                           f"{w.reshape(-1)[i].item()}")
    return out[:limit]


def write_counts(plan: Plan) -> tuple[dict[tuple[int, int], np.ndarray], list[str]]:
    """Per (target rank, region): how often each byte is written in one run, from the
    plan's writes (not into staging) and unpacks; plus overlaps found in staging (two writes
    of one stage into the same staging byte of a rank)."""
    counts: dict[tuple[int, int], np.ndarray] = {}
    staging: dict[tuple[int, int], np.ndarray] = {}
    problems = []
    for rp in plan.ranks:
        if rp.role != "target":
            continue
        for i, reg in enumerate(rp.regions):
            if reg.name != STAGING:
                counts[(rp.rank, i)] = np.zeros(reg.nbytes, dtype=np.int64)
    for rp in plan.ranks:
        w = rp.writes
        stage_of = np.zeros(len(w), dtype=np.int64)
        for b in range(len(rp.batches)):
            stage_of[rp.batches["start"][b]:rp.batches["stop"][b]] = rp.batches["stage"][b]
        for j in range(len(w)):
            peer, reg = int(w["dst_rank"][j]), int(w["dst_region"][j])
            lo = int(w["dst_offset"][j])
            hi = lo + int(w["nbytes"][j])
            region = plan.ranks[peer].regions[reg]
            if lo < 0 or hi > region.nbytes:
                problems.append(f"rank {rp.rank}: write {j} outside rank {peer} {region.name}")
            elif region.name == STAGING:
                staging.setdefault((peer, int(stage_of[j])),
                                   np.zeros(region.nbytes, dtype=np.int64))[lo:hi] += 1
            else:
                counts[(peer, reg)][lo:hi] += 1
        c = rp.copies
        for j in np.flatnonzero(c["kind"] == UNPACK).tolist():
            reg = int(c["dst_region"][j])
            es = ITEMSIZE[rp.regions[reg].dtype]
            i0, i1, i2 = np.meshgrid(*(np.arange(int(c[f"size{d}"][j])) for d in range(3)),
                                     indexing="ij")
            e = c["dst_offset"][j] + i0 * c["dst_stride0"][j] + i1 * c["dst_stride1"][j] \
                + i2 * c["dst_stride2"][j]
            idx = (e.reshape(-1, 1) * es + np.arange(es)).reshape(-1)
            buf = counts[(rp.rank, reg)]
            if len(idx) and (idx.min() < 0 or idx.max() >= len(buf)):
                problems.append(f"rank {rp.rank}: unpack {j} outside {rp.regions[reg].name}")
                continue
            np.add.at(buf, idx, 1)
    for (rank, stage), buf in staging.items():
        if (buf > 1).any():
            problems.append(f"rank {rank} staging: byte {int(np.argmax(buf > 1))} written "
                            f"{int(buf.max())} times in stage {stage}")
    return counts, problems


def covered_bytes(case: Case) -> dict[tuple[int, int], np.ndarray]:
    """Per (target plan rank, region): 1 where a byte belongs to a piece, else 0."""
    ones = {t.name: torch.ones(t.shape) for t in case.spec.tensors}
    out = {}
    for r, tensors in materialize(case.dst, ones).items():
        rl = case.dst.ranks[r]
        for i, pt in enumerate(rl.tensors):
            m = (tensors[pt.name].float().reshape(-1) != 0).numpy()
            out[(case.src.world + r, i)] = np.repeat(m, ITEMSIZE[pt.dtype]).astype(np.int64)
    return out
