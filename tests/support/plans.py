"""Hand-built plans (no compiler needed) for the executor, the simulator and the verifier.

- `rank_plan` turns plain lists into a `RankPlan`: writes get one batch per stage, copies
  take keyword defaults, signals are given by hand (to build wrong ones on purpose too);
  `two_by_two` is the shared 2 sources -> 2 targets example.
- `plan_of` builds a whole plan from per-rank batches and copies, its signals derived by
  the compiler's own rule (`planner.passes.schedule.signal_rows`); `src` and `tgt` are its
  rank rows.
"""

from __future__ import annotations

import numpy as np
import torch

from planner.passes.schedule import signal_rows
from schemas.config import ClusterConfig, Options
from schemas.header import PlanHeader, RankRow
from schemas.plan import (
    ACK,
    BATCH_COLUMNS,
    COPY_COLUMNS,
    DONE,
    DTYPE_CODES,
    PACK,
    READY,
    SIGNAL_COLUMNS,
    STAGING,
    UNPACK,
    WRITE_COLUMNS,
    Plan,
    RankPlan,
    Region,
    Table,
)
from schemas.plan_write import write_plan

BF16, F32 = DTYPE_CODES.index("bfloat16"), DTYPE_CODES.index("float32")
_SIZE = {"uint8": 1, "bfloat16": 2, "float16": 2, "float32": 4}


def region(name: str, dtype: str, shape: tuple[int, ...]) -> Region:
    return Region(name, dtype, shape, int(np.prod(shape)) * _SIZE[dtype])


def copy(kind: int, stage: int, src: tuple, dst: tuple, size: tuple[int, int, int],
         aux_offset: int = 0) -> dict:
    """`src`/`dst` = (region, dtype code, offset, (stride0, stride1, stride2)) in elements."""
    row = {"kind": kind, "stage": stage, "size0": size[0], "size1": size[1], "size2": size[2],
           "aux_offset": aux_offset}
    for side, (reg, code, off, strides) in (("src", src), ("dst", dst)):
        row.update({f"{side}_region": reg, f"{side}_dtype": code, f"{side}_offset": off})
        row.update({f"{side}_stride{k}": strides[k] for k in range(3)})
    return row


def rank_plan(rank: int, role: str, regions: list[Region], writes=(), copies=(), signals=(),
              waits=(), peer_regions=None, stages: int = 1) -> RankPlan:
    """`writes`: (stage, dst_rank, src_region, src_offset, dst_region, dst_offset, nbytes),
    sorted by stage; `signals`/`waits`: (stage, peer, kind); `peer_regions`: {peer: sizes of
    its regions 0..n-1}."""
    writes = sorted(writes, key=lambda w: w[0])
    cols = {n: [w[i + 1] for w in writes] for i, (n, _) in enumerate(WRITE_COLUMNS)}
    w_stage = np.array([w[0] for w in writes], dtype=np.int64)
    batches = {"stage": [], "nic": [], "start": [], "stop": []}
    for s in sorted(set(w_stage.tolist())):
        rows = np.flatnonzero(w_stage == s)
        for k, v in (("stage", s), ("nic", 0), ("start", rows[0]), ("stop", rows[-1] + 1)):
            batches[k].append(v)
    copies_cols = {n: [c[n] for c in copies] for n, _ in COPY_COLUMNS}
    sig = {n: [s[i] for s in signals] for i, (n, _) in enumerate(SIGNAL_COLUMNS)}
    wai = {n: [s[i] for s in waits] for i, (n, _) in enumerate(SIGNAL_COLUMNS)}
    return RankPlan(
        rank=rank, role=role, host=0, gpu=rank, nics=("lo",), regions=tuple(regions),
        writes=Table.build(WRITE_COLUMNS, **cols), batches=Table.build(BATCH_COLUMNS, **batches),
        copies=Table.build(COPY_COLUMNS, **copies_cols), signals=Table.build(SIGNAL_COLUMNS, **sig),
        waits=Table.build(SIGNAL_COLUMNS, **wai),
        peer_regions=tuple(sorted((p, tuple(enumerate(s)))
                                  for p, s in (peer_regions or {}).items())),
        stages=stages)


def save(path: str, ranks: list[RankPlan], fingerprint: str = "test-plan") -> str:
    write_plan(path, Plan(header=PlanHeader(fingerprint=fingerprint, world=len(ranks)),
                          ranks=tuple(ranks)))
    return path


# ----------------------------------------------------------------------- 2 x 2 example
#
# Logical W: [4, 8] bf16. Sources 0, 1 hold row blocks (DP/PP-like): src s has W[2s:2s+2, :]
# as "w" [2, 8]. Targets 2, 3 hold column blocks (TP on dim 1): tgt t has W[:, 4(t-2):+4]
# as "w" [4, 4]. Each source row r, half h is 4 contiguous bf16 = 8 bytes:
#   src offset (r*8 + 4h)*2  ->  target 2+h, row 2s+r, offset (2s+r)*4*2.
# So each source does 4 direct writes of 8 bytes.
#
# Logical B: [4, 6] fp32 on source 0 only ("b"); target 2 wants its column block B[:, 1:5]
# transposed and cast to bf16 ("bt" [4, 4] bf16, bt[j, i] = B[i, 1+j]), through staging:
#   stage 0: src 0 PACKs B[0:2, 1:5] (box 2x4, strides (6, 1), offset 1) as bf16 into its
#            staging (16 bytes), writes them to tgt 2's staging, DONE; tgt 2 UNPACKs into
#            bt[:, 0:2] (dst strides (1, 4): element (i, j) -> bt[j, i]), then ACKs.
#   stage 1: src 0 waits for that ACK (staging free), PACKs B[2:4, 1:5] and so on into
#            bt[:, 2:4].
# Targets send READY at stage 0 to both sources; sources wait for it before writing.

def two_by_two() -> list[RankPlan]:
    w_src = region("w", "bfloat16", (2, 8))
    w_tgt = region("w", "bfloat16", (4, 4))
    b_src = region("b", "float32", (4, 6))
    bt = region("bt", "bfloat16", (4, 4))
    stage_src = region(STAGING, "uint8", (16,))
    stage_tgt = region(STAGING, "uint8", (16,))
    sizes = {2: (w_tgt.nbytes, bt.nbytes, 16), 3: (w_tgt.nbytes,)}
    ranks = []
    for s in (0, 1):
        writes = [(0, 2 + h, 0, (r * 8 + 4 * h) * 2, 0, (2 * s + r) * 4 * 2, 8)
                  for r in (0, 1) for h in (0, 1)]
        regions, copies, signals = [w_src], [], [(0, 2, DONE), (0, 3, DONE)]
        waits = [(0, 2, READY), (0, 3, READY)]
        if s == 0:
            regions = [w_src, b_src, stage_src]
            for st in (0, 1):
                copies.append(copy(PACK, st, (1, F32, 1 + 12 * st, (6, 1, 0)),
                                   (2, BF16, 0, (4, 1, 0)), (2, 4, 1)))
                writes.append((st, 2, 2, 0, 2, 0, 16))
            signals.append((1, 2, DONE))
            waits.append((1, 2, ACK))
        ranks.append(rank_plan(s, "source", regions, writes, copies, signals, waits,
                               {t: sizes[t] for t in (2, 3)}, stages=2))
    t2_copies = [copy(UNPACK, st, (2, BF16, 0, (4, 1, 0)), (1, BF16, 2 * st, (1, 4, 0)),
                      (2, 4, 1)) for st in (0, 1)]
    ranks.append(rank_plan(2, "target", [w_tgt, bt, stage_tgt], copies=t2_copies,
                           signals=[(0, 0, READY), (0, 1, READY), (0, 0, ACK)],
                           waits=[(0, 0, DONE), (0, 1, DONE), (1, 0, DONE)], stages=2))
    ranks.append(rank_plan(3, "target", [w_tgt], signals=[(0, 0, READY), (0, 1, READY)],
                           waits=[(0, 0, DONE), (0, 1, DONE)], stages=2))
    return ranks


def two_by_two_tensors(seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Source data for `seed`, and zeroed targets."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(4, 8, generator=g).to(torch.bfloat16)
    B = torch.randn(4, 6, generator=g)
    return {0: {"w": W[0:2].clone(), "b": B.clone()}, 1: {"w": W[2:4].clone()},
            2: {"w": torch.zeros(4, 4, dtype=torch.bfloat16),
                "bt": torch.zeros(4, 4, dtype=torch.bfloat16)},
            3: {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}}


def two_by_two_expected(seed: int) -> dict[int, dict[str, torch.Tensor]]:
    src = two_by_two_tensors(seed)
    W = torch.cat([src[0]["w"], src[1]["w"]])
    B = src[0]["b"]
    return {2: {"w": W[:, 0:4], "bt": B[:, 1:5].t().to(torch.bfloat16)}, 3: {"w": W[:, 4:8]}}


# ----------------------------------------------------------------- plans for the simulator
#
# Units: a 400 Gb/s NIC moves 50 GB/s, so 1 GB takes 20 ms; NVLink at 3600 Gb/s moves
# 450 GB/s.

GB = 10**9
NIC_BPS = 50e9
NV_BPS = 450e9


def plan_of(ranks: list[dict], nics_per_host: int = 8, overhead_us: float = 0.0,
            pack_us: float = 0.0, acks: bool = False) -> Plan:
    """A plan from rank dicts (`src`, `tgt`): role, host, gpu, batches [(stage, chan, dst,
    bytes, writes)], copies [(kind, stage, bytes)]. Signals as the compiler derives them:
    READY per pair, DONE per pair and stage with writes, and (with `acks`: every write
    lands in the target's staging) ACK for every such stage >= 1."""
    g_per_nic = 8 // nics_per_host
    names = [f"h{r['host']}/nic{r['gpu'] // g_per_nic}" for r in ranks]
    stages = 1 + max([b[0] for r in ranks for b in r.get("batches", ())] +
                     [c[1] for r in ranks for c in r.get("copies", ())], default=0)
    rows = np.array([(s, b[2], b[0]) for s, r in enumerate(ranks)
                     for b in r.get("batches", ())], dtype=np.int64).reshape(-1, 3)
    sent, awaited = signal_rows(rows[:, 0], rows[:, 1], rows[:, 2],
                                np.full(len(rows), acks, dtype=bool))
    out = [RankPlan(rank=i, role=r["role"], host=r["host"], gpu=r["gpu"],
                    nics=(names[i], "nvlink"), regions=(), writes=_writes(r),
                    batches=_batches(r), copies=_copies(r), signals=_signal_table(sent, i),
                    waits=_signal_table(awaited, i), peer_regions=(), stages=stages)
           for i, r in enumerate(ranks)]
    header = PlanHeader(
        options=Options(write_overhead_us=overhead_us, pack_gbps=2000.0,
                        pack_overhead_us=pack_us),
        cluster=ClusterConfig(nic_gbps=400.0, nvlink_gbps=3600.0), nvlink_gbps=3600.0,
        ranks=tuple(RankRow(r["role"], r["host"], r["gpu"], names[i])
                    for i, r in enumerate(ranks)))
    return Plan(header=header, ranks=tuple(out))


def _writes(r: dict) -> Table:
    w: dict[str, list[int]] = {k: [] for k, _ in WRITE_COLUMNS}
    for _, _, dst, nbytes, n in r.get("batches", ()):
        for _ in range(n):
            for k, v in (("dst_rank", dst), ("src_region", 0), ("src_offset", 0),
                         ("dst_region", 0), ("dst_offset", 0), ("nbytes", nbytes // n)):
                w[k].append(v)
    return Table.build(WRITE_COLUMNS, **w)


def _batches(r: dict) -> Table:
    b: dict[str, list[int]] = {k: [] for k, _ in BATCH_COLUMNS}
    start = 0
    for stage, chan, _, _, n in r.get("batches", ()):
        for k, v in (("stage", stage), ("nic", chan), ("start", start), ("stop", start + n)):
            b[k].append(v)
        start += n
    return Table.build(BATCH_COLUMNS, **b)


def _copies(r: dict) -> Table:
    c: dict[str, list[int]] = {k: [] for k, _ in COPY_COLUMNS}
    for kind, stage, nbytes in r.get("copies", ()):
        row = dict.fromkeys(c, 0)
        row.update(kind=kind, stage=stage, src_dtype=1, dst_dtype=1, size0=nbytes // 2,
                   size1=1, size2=1)
        for k in c:
            c[k].append(row[k])
    return Table.build(COPY_COLUMNS, **c)


def _signal_table(rows: np.ndarray, rank: int) -> Table:
    mine = rows[rows[:, 0] == rank]
    return Table.build(SIGNAL_COLUMNS, stage=mine[:, 1], peer=mine[:, 2], kind=mine[:, 3])


def src(host: int, gpu: int, *batches: tuple, copies: tuple = ()) -> dict:
    return {"role": "source", "host": host, "gpu": gpu, "batches": batches, "copies": copies}


def tgt(host: int, gpu: int, copies: tuple = ()) -> dict:
    return {"role": "target", "host": host, "gpu": gpu, "copies": copies}
