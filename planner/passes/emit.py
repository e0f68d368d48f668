"""Passes 11 and 12 (header, `emit`): the plan (schemas) from the scheduled writes and copies.

Per rank: its regions (physical tensors in layout order, then staging), the writes it
issues in scheduled order, batches, copies, signals, waits and the sizes of the peer
regions it writes into. The header (`plan_header`, a `schemas.header.PlanHeader`) records
everything the compiler decided: options, source/target configs, topology, per-NIC bytes,
stats, the fingerprint, and facts readers would otherwise re-derive (whether every source
holds the whole model, the longest row).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import msgpack
import numpy as np

from planner import frameworks
from planner.layouts.base import Layout, PhysicalTensor
from planner.passes.intersect import PieceTable, Repeated
from planner.passes.lower import Lowered
from planner.passes.lower_cols import as_dtype, is_constant
from planner.passes.schedule import Schedule
from planner.rows import Scratch, lexorder, pair_sums, unique_rows
from planner.spec import ModelSpec
from planner.topology import Topology
from schemas.config import Config, SourceConfig
from schemas.header import ModelInfo, NicRow, PlanHeader, PlanStats, RankRow, RankStats
from schemas.plan import (
    BATCH_COLUMNS,
    COPY_COLUMNS,
    COVERAGE_COLUMNS,
    DAG_EDGE_COLUMNS,
    DAG_NODE_COLUMNS,
    FORMAT_VERSION,
    ITEMSIZE,
    PACK,
    QUANT,
    SIGNAL_COLUMNS,
    STAGING,
    UNPACK,
    WRITE_COLUMNS,
    Plan,
    RankPlan,
    Region,
    Table,
)


def tensor_regions(layout: Layout) -> list[tuple[Region, ...]]:
    """The regions of each rank's physical tensors (built once for replicas sharing them:
    one tuple of regions for all; and one region for all tensors of one name, dtype and
    shape: a sharded model's ranks hold many alike)."""
    built: dict[int, tuple[Region, ...]] = {}
    alike: dict[tuple[str, str, tuple[int, ...]], Region] = {}
    out = []
    for rl in layout.ranks:
        regs = built.get(id(rl.tensors))
        if regs is None:
            regs = built[id(rl.tensors)] = tuple(_region(t, alike) for t in rl.tensors)
        out.append(regs)
    return out


def _region(t: PhysicalTensor, alike: dict[tuple[str, str, tuple[int, ...]], Region]
            ) -> Region:
    if type(t.shape) is not tuple:  # (a layout's own sequence: not a key)
        return Region(t.name, t.dtype, t.shape, math.prod(t.shape) * ITEMSIZE[t.dtype])
    key = (t.name, t.dtype, t.shape)
    r = alike.get(key)
    if r is None:
        r = alike[key] = Region(t.name, t.dtype, t.shape,
                                math.prod(t.shape) * ITEMSIZE[t.dtype])
    return r


def rank_regions(src: list[tuple[Region, ...]], dst: list[tuple[Region, ...]],
                 staging: np.ndarray | None = None) -> list[tuple[Region, ...]]:
    """Regions of every plan rank: its physical tensors (`tensor_regions` of the source
    and target layouts), then staging when it has any (`staging`: bytes per plan rank;
    none yet when not given, see `with_staging`)."""
    out = [*src, *dst]
    return out if staging is None else with_staging(out, staging)


def with_staging(regions: list[tuple[Region, ...]], staging: np.ndarray
                 ) -> list[tuple[Region, ...]]:
    """`regions` (of `rank_regions`, without staging) with each rank's staging region
    appended where it has one."""
    return [(*regs, Region(STAGING, "uint8", (int(n),), int(n))) if n else regs
            for regs, n in zip(regions, staging.tolist())]


def _slices(sorted_keys: np.ndarray, world: int) -> np.ndarray:
    """Where each of ranks 0..world starts in `sorted_keys` (the ranks in its dtype: a wider
    one would have the whole column cast to it first)."""
    return np.searchsorted(sorted_keys, np.arange(world + 1, dtype=sorted_keys.dtype))


def _table(schema, rows: np.ndarray, names: tuple[str, ...]) -> Table:
    return Table.build(schema, **{n: rows[:, i] for i, n in enumerate(names)})


def source_replicated(src: SourceConfig) -> bool:
    """Whether every source rank holds the whole model (pure data parallelism): the
    framework's own rule (`planner.frameworks`)."""
    return frameworks.of(src).replicated(src)


def longest_row_bytes(spec: ModelSpec) -> int:
    """An upper bound on one row (last dim) of any logical tensor, in bytes: a chunk is never
    cut inside a row, so a row longer than `max_write_bytes` is one chunk."""
    d = spec.dims
    cols = [2 * d.hidden, d.intermediate, d.moe_intermediate, d.shared_intermediate,
            d.heads * d.head_dim, d.heads * d.v_head_dim, d.q_lora_rank, d.kv_lora_rank]
    return 4 * max(cols)


def rank_stats(low: Lowered, world: int,
               pairs: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[RankStats, ...]:
    """Per plan rank: writes issued, bytes sent and received, packs, unpacks, staging.
    `pairs`: the writes and their bytes per (source, target) pair (`rows.pair_sums`), the
    write columns' sums read from them where given."""
    if pairs is None:
        pairs = pair_sums(low.w_src_rank, low.w_dst_rank, low.w_nbytes, world)
    if pairs is not None:
        count, sent, recv = pairs[0].sum(axis=1), pairs[1].sum(axis=1), pairs[1].sum(axis=0)
    else:
        count = np.bincount(low.w_src_rank, minlength=world)
        sent = np.bincount(low.w_src_rank, weights=low.w_nbytes, minlength=world)
        recv = np.bincount(low.w_dst_rank, weights=low.w_nbytes, minlength=world)
    kind, rank = low.copies["kind"], low.copies["rank"]
    packs = np.bincount(rank[(kind == PACK) | (kind == QUANT)], minlength=world)
    unpacks = np.bincount(rank[kind == UNPACK], minlength=world)
    cols = (count, sent, recv, packs, unpacks, low.staging)
    return tuple(RankStats(*(int(c[r]) for c in cols)) for r in range(world))


def plan_header(cfg: Config, spec: ModelSpec, topo: Topology, replicas: int, low: Lowered,
                nic: dict[str, Any], chunks: int, unit_max: int, fingerprint: str,
                created_by: str, pairs: tuple[np.ndarray, np.ndarray] | None = None
                ) -> PlanHeader:
    """Everything the compiler decided about the whole plan (`nic`: from
    `planner.nic_stats.nic_stats`; `pairs`: `rank_stats`')."""
    kinds = low.copies["kind"]
    return PlanHeader(
        fingerprint=fingerprint, world=topo.world, sources=topo.sources,
        targets=topo.targets, replicas=replicas, stages=low.stages, created_by=created_by,
        model=ModelInfo(spec.dims.model_type, spec.dims.num_layers, spec.total_params,
                        len(spec.tensors), longest_row_bytes(spec), spec.dims.vocab),
        source=cfg.source, target=cfg.target, cluster=cfg.cluster, options=cfg.options,
        nvlink_gbps=topo.nvlink_gbps, placement=cfg.target.placement,
        ranks=tuple(RankRow("source" if r < topo.sources else "target", topo.host[r],
                            topo.gpu[r], topo.nic_name(topo.nic[r])) for r in range(topo.world)),
        rank_stats=rank_stats(low, topo.world, pairs),
        nics=tuple(NicRow(n["name"], n["host"], float(n["gbps"]), n["bytes_out"],
                          n["bytes_in"]) for n in nic["nics"]),
        stats=PlanStats(
            writes=int(len(low.w_nbytes)), bytes=int(low.w_nbytes.sum()),
            packs=int((kinds == PACK).sum()), unpacks=int((kinds == UNPACK).sum()),
            quants=int((kinds == QUANT).sum()), chunks=chunks, gather_unit_max=int(unit_max),
            staging_max=int(low.staging.max()) if len(low.staging) else 0,
            nvlink_bytes=nic["nvlink_bytes"], remote_bytes=nic["remote_bytes"],
            floor_s=nic["floor_s"],
            egress_bound_max_over_mean=nic["egress_bound_max_over_mean"]),
        source_replicated=source_replicated(cfg.source))


def emit(header: PlanHeader, ops: list[tuple[Lowered, Schedule]], topo: Topology,
         regions: list[tuple[Region, ...]], explain: Table, tensors: tuple[str, ...],
         coverage: Table) -> Plan:
    """The plan: every rank's tables, the explain, DAG and coverage tables, `header`.

    `ops`: a list of the lowered ops and their schedule, holding the only references to
    them; they are consumed: the write columns are put in scheduled order (in place, or,
    for offsets and bytes held as int32, into int64 copies, each int32 one dropped once
    copied), and the copies in (rank, stage, kind) order and the plan's dtypes, in place
    (`_all_in_order`; the schedule's order itself, read no more, holds the last column
    copied), so each rank's tables are views of them and the plan holds no second copy of
    the op tables (the compiler reads them no more)."""
    world = topo.world
    low, sched = ops.pop()
    o, scratch = sched.order, Scratch()
    sched = dataclasses.replace(sched, order=o[:0].copy())  # `o`: the only reference
    cols = {k: getattr(low, f"w_{k}") for k in (
        "src_rank", "dst_rank", "src_region", "dst_region", "stage", "src_offset",
        "dst_offset", "nbytes")}
    _all_in_order(cols, o, scratch, {"src_offset": np.int64, "dst_offset": np.int64,
                                     "nbytes": np.int64})  # (the plan's offsets and bytes)
    del o
    low = dataclasses.replace(low, **{f"w_{k}": v for k, v in cols.items()})
    w = {k: cols[k] for k in ("dst_rank", "src_region", "dst_region", "src_offset",
                              "dst_offset", "nbytes")}
    del cols
    w_src = low.w_src_rank
    w_cut = _slices(w_src, world)
    b_start = sched.batch_start
    b_stop = np.append(b_start[1:], len(w_src))
    b_rank = w_src[b_start] if len(b_start) else b_start
    b_cut = _slices(b_rank, world)
    b_stage = low.w_stage[b_start]  # once: indexing it per rank was 8M x 512
    c = low.copies
    c_order = lexorder(c["kind"], c["stage"], c["rank"])  # stable: ties keep their order
    plan_dt = dict(COPY_COLUMNS)
    varied = {k: v for k, v in c.items() if not is_constant(v)}  # (a constant column is
    # in any order)
    _all_in_order(varied, c_order, scratch, plan_dt)  # in the plan's dtypes
    del c_order, scratch
    c.update(varied)
    del varied
    for name, dt in COPY_COLUMNS:
        if is_constant(c[name]):
            c[name] = as_dtype(c[name], dt)
    c_cut = _slices(c["rank"], world)
    # a constant column's rows of every rank: views of one array of its value (contiguous,
    # as a table's columns are), as long as the most any rank has
    most = int(np.diff(c_cut).max()) if world else 0
    for name, _ in COPY_COLUMNS:
        if is_constant(c[name]):
            c[name] = _Shared(np.full(most, c[name][0], dtype=c[name].dtype))
    s_cut = _slices(sched.signals[:, 0], world)
    wt_cut = _slices(sched.waits[:, 0], world)
    sizes = [len(regs) for regs in regions]
    first_region = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    # each plan region's (region, nbytes) item, made once for every rank that writes there
    # (the ranks' `peer_regions` share them: millions of rows, far fewer regions)
    region_items = [(i, int(r.nbytes)) for regs in regions for i, r in enumerate(regs)]
    ranks = []
    for r in range(world):
        ws = slice(w_cut[r], w_cut[r + 1])
        bs = slice(b_cut[r], b_cut[r + 1])
        pairs = unique_rows(np.stack([w["dst_rank"][ws], w["dst_region"][ws]], axis=1)) \
            if ws.stop > ws.start else np.zeros((0, 2), dtype=np.int64)
        ranks.append(RankPlan(
            rank=r, role="source" if r < topo.sources else "target", host=topo.host[r],
            gpu=topo.gpu[r], nics=(topo.nic_name(topo.nic[r]), "nvlink"), regions=regions[r],
            writes=Table.build(WRITE_COLUMNS, **{k: v[ws] for k, v in w.items()}),
            batches=Table.build(BATCH_COLUMNS, stage=b_stage[bs],
                                nic=sched.batch_nic[bs], start=b_start[bs] - w_cut[r],
                                stop=b_stop[bs] - w_cut[r]),
            copies=Table.build(COPY_COLUMNS, **{n: c[n].rows(c_cut[r], c_cut[r + 1])
                                                if type(c[n]) is _Shared else
                                                c[n][c_cut[r]:c_cut[r + 1]]
                                                for n, _ in COPY_COLUMNS}),
            signals=_table(SIGNAL_COLUMNS, sched.signals[s_cut[r]:s_cut[r + 1], 1:],
                           ("stage", "peer", "kind")),
            waits=_table(SIGNAL_COLUMNS, sched.waits[wt_cut[r]:wt_cut[r + 1], 1:],
                         ("stage", "peer", "kind")),
            peer_regions=_peer_regions(pairs, region_items, first_region),
            stages=low.stages,
        ))
    nodes = _table(DAG_NODE_COLUMNS, sched.dag_nodes, ("rank", "stage", "phase"))
    edges = _table(DAG_EDGE_COLUMNS, sched.dag_edges, ("u", "v"))
    return Plan(header=header, ranks=tuple(ranks), explain=explain, tensors=tensors,
                dag_nodes=nodes, dag_edges=edges, coverage=coverage)


class _Shared:
    """A constant copy column of the plan: each rank's rows a view of `value`'s first."""

    __slots__ = ("value",)

    def __init__(self, value: np.ndarray) -> None:
        value.flags.writeable = False
        self.value = value

    def rows(self, lo: int, hi: int) -> np.ndarray:
        return self.value[:hi - lo]


def _permute(col: np.ndarray, order: np.ndarray, scratch: Scratch) -> None:
    """`col[:] = col[order]`: a column put in order in place (through `scratch`)."""
    col[:] = scratch.taken(col, order)


def _all_in_order(cols: dict[str, np.ndarray], order: np.ndarray, scratch: Scratch,
                  dts: dict[str, Any]) -> None:
    """Every column of `cols` put in `order` (a permutation, held by nothing else) and in
    its dtype in `dts` (its own where not named), in the dict: a column of that dtype in
    place (`_permute`), those of one dtype one after another (one buffer each); one of
    another dtype into an array of its dtype, in memory whose pages are in already where there is
    some: the buffer of the last dtype put in place where it is of that dtype, then `order`
    itself once the last column is taken (an int64 column of as many rows, read no more),
    else a new array (its pages zeroed by the kernel as they are first touched)."""
    dt = {k: np.dtype(dts.get(k, v.dtype)) for k, v in cols.items()}
    for k in sorted((k for k in cols if cols[k].dtype == dt[k]), key=lambda k: dt[k].str):
        _permute(cols[k], order, scratch)
    cast = sorted((k for k in cols if cols[k].dtype != dt[k]), key=lambda k: dt[k].str)
    n = len(order)
    spares = [] if not cast else [b for b in (scratch.spare(dt[cast[0]], n),)
                                  if b is not None]
    for i, k in enumerate(cast):
        got = scratch.taken(cols[k], order)
        if spares and spares[-1].dtype == dt[k]:
            out = spares.pop()
        elif i == len(cast) - 1 and _free(order, dt[k]):
            out = order  # (read no more: `got` is taken)
        else:
            out = np.empty(n, dtype=dt[k])
        np.copyto(out, got, casting="unsafe")  # (as `astype`)
        cols[k] = out


def _free(order: np.ndarray, dt: np.dtype) -> bool:
    """Whether `order` may hold a column of `dt` (its own array, of that dtype, writable)."""
    return order.dtype == dt and order.base is None and order.flags.writeable and \
        order.flags.c_contiguous


def _peer_regions(pairs: np.ndarray, region_items: list[tuple[int, int]],
                  first_region: np.ndarray
                  ) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
    """(peer, ((region, nbytes), ...)) for the (peer, region) pairs a rank writes into
    (sorted; `region_items`: every rank's (region, nbytes) items in one list, rank r's from
    `first_region[r]` on)."""
    if len(pairs) == 0:
        return ()
    peer, region = pairs[:, 0], pairs[:, 1]
    items = list(map(region_items.__getitem__, (first_region[peer] + region).tolist()))
    cut = np.flatnonzero(np.concatenate([[True], peer[1:] != peer[:-1], [True]])).tolist()
    return tuple((int(peer[a]), tuple(items[a:b])) for a, b in zip(cut[:-1], cut[1:]))


def coverage_table(dst: Layout, rank_base: int, pieces: PieceTable) -> Table:
    """Logical bytes of every target region (elements covered by pieces x itemsize);
    `pieces`: the target layout's piece table (`intersect.piece_table`)."""
    rank, region, item, first = [], [], [], {}
    for rl in dst.ranks:
        first[rank_base + rl.rank] = len(rank)
        for i, t in enumerate(rl.tensors):
            rank.append(rank_base + rl.rank)
            region.append(i)
            item.append(ITEMSIZE[t.dtype])
    start = np.zeros(max(first, default=-1) + 1, dtype=np.int64)
    start[list(first)] = list(first.values())
    at = start[pieces.rank] + pieces.region
    numel = np.bincount(at, weights=(pieces.size0 * pieces.size1).astype(np.float64),
                        minlength=len(rank)).astype(np.int64)  # exact below 2^53
    return Table.build(COVERAGE_COLUMNS, rank=rank, region=region,
                       nbytes=numel * np.array(item, dtype=np.int64))


def _packed_regions(regions: list[tuple[Region, ...]]) -> bytes:
    """msgpack of every rank's (name, dtype, shape) regions less staging, as one list: its
    array header, then each rank's list packed (once per distinct tuple of regions)."""
    packer, done = msgpack.Packer(), {}
    parts = [packer.pack_array_header(len(regions))]
    for regs in regions:
        if id(regs) not in done:
            done[id(regs)] = packer.pack([(r.name, r.dtype, list(r.shape)) for r in regs
                                          if r.name != STAGING])
        parts.append(done[id(regs)])
    return b"".join(parts)


_HASHED = 1 << 20
"""Rows of a piece table column cast to its hashed width and hashed at a time."""
_I32 = np.iinfo(np.int32)


def _hash_column(h: Any, col: np.ndarray, block: np.ndarray) -> None:
    """Feed `h` a piece table column by value, whatever integer type holds it: a width tag
    (`4` when every value fits in int32, else `8`), then the values as little-endian
    integers of that width. A little-endian int32 column is hashed in place, a `Repeated`
    one a copy at a time."""
    narrow = len(col) == 0 or (col.dtype.kind == "i" and col.dtype.itemsize <= 4) or (
        int(col.min()) >= _I32.min and int(col.max()) <= _I32.max)
    h.update(b"4" if narrow else b"8")
    want = np.dtype("<i4" if narrow else "<i8")
    if isinstance(col, Repeated):  # a copy at a time: the same bytes in the same order
        for part in col.copies():
            h.update(memoryview(np.ascontiguousarray(part, dtype=want)).cast("B"))
        return
    if col.dtype == want and col.flags.c_contiguous:
        h.update(memoryview(col).cast("B"))
        return
    buf = block.view(want)
    for at in range(0, len(col), _HASHED):
        part = col[at:at + _HASHED]
        np.copyto(buf[:len(part)], part, casting="unsafe")  # (as `astype`)
        h.update(buf[:len(part)].data)


def fingerprint(spec: ModelSpec, src: PieceTable, dst: PieceTable,
                regions: list[tuple[Region, ...]], topo: Topology, cfg: Config) -> str:
    """Digest of what the plan depends on: spec, piece tables (their values, not the integer
    type that holds them), regions, topology, options. SHA-256 (its first 16 bytes, in hex):
    the piece tables are hundreds of MB on the largest models, and SHA-256 runs in the CPU's
    SHA instructions where it has them (x86-64 since about 2017-2019, Armv8)."""
    h = hashlib.sha256()
    h.update(msgpack.packb([FORMAT_VERSION, [(t.name, list(t.shape), t.dtype)
                                             for t in spec.tensors]]))
    block = np.empty(_HASHED, dtype=np.int64)  # one buffer: no fresh pages per block
    for table in (src, dst):  # (not `dataclasses.astuple`: it deep-copies every column)
        for f in dataclasses.fields(table):
            _hash_column(h, getattr(table, f.name), block)
    h.update(_packed_regions(regions))
    h.update(msgpack.packb([list(topo.host), list(topo.gpu), list(topo.nic),
                            topo.nic_gbps, topo.nvlink_gbps]))
    h.update(msgpack.packb(dataclasses.asdict(cfg.options)))
    return h.hexdigest()[:32]
