"""The compiler: a config -> a plan, through the passes, each a pure function.

    spec -> layouts -> intersect -> (split rows) -> assign -> lower -> coalesce
         -> schedule -> emit

Everything the plan depends on (spec, both layouts, topology, options) goes into its
fingerprint; nothing that varies between runs (time, paths) goes into the file, so
compiling the same config twice gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any

import msgpack
import numpy as np

from planner.derived import derived
from planner.fp8 import FP8, SCALE_SUFFIX, with_scales
from planner.identities import rank_identities, with_rank_tensors
from planner.layouts import build_layout
from planner.layouts.base import Layout
from planner.passes.assign import assign, split_rows
from planner.passes.coalesce import coalesce
from planner.passes.emit import coverage_table, emit, explain_table, plan_header, rank_regions
from planner.passes.gather import gather, take
from planner.passes.intersect import PieceTable, element_size, intersect, piece_table
from planner.passes.lower import Lowered, lower
from planner.passes.schedule import schedule
from planner.spec import ModelSpec
from planner.topology import Topology, build_topology
from schemas.config import Config
from schemas.integrity import plan_key
from schemas.plan import DTYPE_CODES, FORMAT_VERSION, Plan, write_plan

VERSION = "rdma-plan 0.1.0"


def _fingerprint(spec: ModelSpec, src: PieceTable, dst: PieceTable, regions: list,
                 topo: Topology, cfg: Config) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(msgpack.packb([FORMAT_VERSION, [(t.name, list(t.shape), t.dtype)
                                             for t in spec.tensors]]))
    for table in (src, dst):
        for col in dataclasses.astuple(table):
            h.update(np.ascontiguousarray(col).tobytes())
    h.update(msgpack.packb([[(r.name, r.dtype, list(r.shape)) for r in regs
                             if r.name != "__staging__"] for regs in regions]))
    h.update(msgpack.packb([list(topo.host), list(topo.gpu), list(topo.nic),
                            topo.nic_gbps, topo.nvlink_gbps]))
    h.update(msgpack.packb(dataclasses.asdict(cfg.options)))
    return h.hexdigest()


def _nic_stats(topo: Topology, src_rank: np.ndarray, dst_rank: np.ndarray,
               nbytes: np.ndarray) -> dict[str, Any]:
    host, nic = np.asarray(topo.host), np.asarray(topo.nic)
    remote = host[src_rank] != host[dst_rank]
    n_nics = int(nic.max()) + 1
    out_b = np.bincount(nic[src_rank[remote]], weights=nbytes[remote], minlength=n_nics)
    in_b = np.bincount(nic[dst_rank[remote]], weights=nbytes[remote], minlength=n_nics)
    nv = np.bincount(src_rank[~remote], weights=nbytes[~remote], minlength=topo.world)
    nv_in = np.bincount(dst_rank[~remote], weights=nbytes[~remote], minlength=topo.world)
    used = sorted(set(topo.nic))
    nics = [{"name": topo.nic_name(n), "host": n // topo.nics_per_host,
             "gbps": topo.nic_gbps, "bytes_out": int(out_b[n]), "bytes_in": int(in_b[n])}
            for n in used]
    nic_floor = max(max(out_b.max(), in_b.max()) * 8 / (topo.nic_gbps * 1e9), 0.0)
    nv_floor = max(nv.max(), nv_in.max()) * 8 / (topo.nvlink_gbps * 1e9)
    return {"nics": nics, "nvlink_bytes": int(nv.sum()), "remote_bytes": int(nbytes[remote]
            .sum()), "floor_s": float(max(nic_floor, nv_floor))}


def _fine_cut(spec: ModelSpec, src: PieceTable, dst: PieceTable, cfg: Config,
              topo: Topology) -> np.ndarray:
    """Rows of `dst` whose box is worth gathering on one source first: a box cut into `c`
    source chunks and held by `h` target ranks takes `c * h` writes directly and `c + h`
    gathered; gather when the writes saved cost more than one more hop of the box."""
    if len(dst) == 0:
        return np.zeros(0, dtype=np.int64)
    keys = np.stack([dst.tensor, dst.off0, dst.off1, dst.size0, dst.size1], axis=1)
    _, first, inv = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    holders = np.bincount(inv)
    ch = intersect(spec, src, take(dst, first))
    chunks = np.bincount(ch.dst, minlength=len(first))
    numel = dst.size0[first] * dst.size1[first]
    nbytes = numel * element_size(dst.dtype[first])
    saved_us = (chunks * holders - chunks - holders) * cfg.options.write_overhead_us
    hop_us = nbytes * 8e-3 / topo.nic_gbps
    # Staging the owner needs: the gathered box (source dtype), and its cast (target dtype).
    one = ch.holders[ch.holder_ptr[ch.sbox[np.searchsorted(ch.dst, np.arange(len(first)))]]] \
        if len(ch) else np.zeros(len(first), dtype=np.int64)
    es_src = element_size(src.dtype[one]) if len(src) else np.ones(len(first), np.int64)
    cast = src.dtype[one] != dst.dtype[first] if len(src) else np.zeros(len(first), bool)
    need = numel * es_src + np.where(cast, nbytes, 0)
    fine = (chunks >= 2) & (holders >= 2) & (saved_us > hop_us)
    # A gather moves rows: boxes stored transposed (on either side) stay on the direct path.
    transposed = np.zeros(len(spec.tensors), dtype=bool)
    transposed[src.tensor[(src.a1 != 1) & (src.size1 > 1)]] = True
    transposed[dst.tensor[(dst.a1 != 1) & (dst.size1 > 1)]] = True
    fine &= ~transposed[dst.tensor[first]]
    fine &= need + 256 <= cfg.options.staging_bytes - cfg.options.staging_bytes // 4
    return np.nonzero(fine[inv])[0]


def _egress_bound(chunks, src: PieceTable, dst: PieceTable, topo: Topology,
                  nbytes: np.ndarray, owner_only: np.ndarray) -> float:
    """A lower bound on the busiest source NIC that no assignment can beat: the bytes a
    set S of source NICs alone can send must leave through S, so some NIC of S sends at
    least bytes(S) / |S|, where bytes(S) counts what only S holds and what only one NIC of
    S holds (taken over the candidate sets that occur). `owner_only`: bytes per source
    rank of gathered boxes only it can own."""
    host, nic = np.asarray(topo.host), np.asarray(topo.nic)
    bound = float(np.bincount(nic[:topo.sources], weights=owner_only[:topo.sources]).max()) \
        if topo.sources else 0.0
    ptr, holders = chunks.holder_ptr, chunks.holders
    sets: dict[int, tuple[int, ...]] = {}
    per_set: dict[tuple[int, ...], float] = {}
    dst_host = host[dst.rank[chunks.dst]]
    for sb, dh, b in zip(chunks.sbox.tolist(), dst_host.tolist(), nbytes.tolist()):
        key = sets.get(sb)
        if key is None:
            ranks = src.rank[holders[ptr[sb]:ptr[sb + 1]]]
            key = sets[sb] = tuple(sorted(set(nic[ranks].tolist()))) \
                if not (host[ranks] == dh).any() else ()
        if key:
            per_set[key] = per_set.get(key, 0.0) + b
    single = {k[0]: b for k, b in per_set.items() if len(k) == 1}
    for n, b in enumerate(np.bincount(nic[:topo.sources], weights=owner_only[:topo.sources])
                          .tolist() if topo.sources else []):
        single[n] = single.get(n, 0.0) + b
    for key, b in per_set.items():  # what only S holds, and what only one NIC of S holds
        inner = sum(single.get(n, 0.0) for n in key) if len(key) > 1 else 0.0
        bound = max(bound, (b + inner) / len(key))
    return bound


def merge(a: Lowered, b: Lowered) -> Lowered:
    """Writes and copies of both; staging per rank is the larger (their stages differ)."""
    cat = np.concatenate
    w = {k: cat([getattr(a, k), getattr(b, k)]) for k in Lowered.__slots__
         if k.startswith("w_")}
    copies = {k: cat([a.copies[k], b.copies[k]]) for k in a.copies}
    return Lowered(**w, copies=copies, staging=np.maximum(a.staging, b.staging),
                   stages=max(a.stages, b.stages))


def compile_config(cfg: Config, spec: ModelSpec, progress=None) -> Plan:
    """Compile a checked config and its model spec into a plan."""
    if progress is not None:
        progress("layouts")
    src_layout = build_layout(spec, cfg.source)
    dst_layout = build_layout(spec, cfg.target)
    if cfg.target.dtype == "fp8_block128":
        spec = with_scales(spec)
    return compile_layouts(cfg, spec, src_layout, dst_layout, progress)


def compile_layouts(cfg: Config, spec: ModelSpec, src_layout: Layout, dst_layout: Layout,
                    progress=None) -> Plan:
    """Compile two given layouts (the rest of `cfg`: cluster, options)."""
    def step(name: str) -> None:
        if progress is not None:
            progress(name)

    topo = build_topology(cfg.cluster, src_layout.world, dst_layout.world)
    step("intersect")
    src = piece_table(src_layout, spec, 0)
    dst = piece_table(dst_layout, spec, src_layout.world)
    n_regions = np.array([len(r.tensors) for r in (*src_layout.ranks, *dst_layout.ranks)],
                         dtype=np.int64)
    # Block-FP8 weights (their scales come along) and fine-cut boxes take the gather pass.
    fp8 = np.isin(dst.tensor, [i for i, t in enumerate(spec.tensors) if
                               spec.by_name.get(t.name + SCALE_SUFFIX)])
    fp8 &= dst.dtype == DTYPE_CODES.index(FP8)
    scales = np.isin(dst.tensor, [i for i, t in enumerate(spec.tensors)
                                  if t.name.endswith(SCALE_SUFFIX)])
    plain = np.nonzero(~fp8 & ~scales)[0]
    fine = plain[_fine_cut(spec, src, take(dst, plain), cfg, topo)]
    plain = np.setdiff1d(plain, fine)
    gathered = np.sort(np.concatenate([np.nonzero(fp8)[0], fine]))
    full_dst, dst = dst, take(dst, plain)
    chunks = intersect(spec, src, dst)
    chunks = split_rows(chunks, dst, cfg.options.max_write_bytes)
    step("assign")
    choice = assign(chunks, src, dst, topo)
    names = [t.name for t in spec.tensors]
    chunk_bytes = chunks.size0 * chunks.size1 * element_size(dst.dtype[chunks.dst])
    ex = np.stack([chunks.tensor, src.rank[choice], src.region[choice], dst.rank[chunks.dst],
                   dst.region[chunks.dst], chunk_bytes], axis=1)
    step("lower")
    low = lower(chunks, choice, src, dst, n_regions, cfg.options, names)
    if len(gathered):
        step("gather")
        host, nic = np.asarray(topo.host), np.asarray(topo.nic)
        remote = host[low.w_src_rank] != host[low.w_dst_rank]
        sent = np.bincount(nic[low.w_src_rank[remote]], weights=low.w_nbytes[remote],
                           minlength=int(nic.max()) + 1)
        more, ex_more, owner_only, unit_max = gather(spec, src, full_dst, gathered,
                                                     np.nonzero(scales)[0], n_regions,
                                                     cfg.options, low.stages, host, nic,
                                                     sent)
        low = merge(low, more)
        ex = np.concatenate([ex, ex_more])
    else:
        owner_only, unit_max = np.zeros(len(n_regions), dtype=np.int64), 0
    explain = explain_table(*ex.T)
    bound = _egress_bound(chunks, src, dst, topo, chunk_bytes, owner_only)
    low = coalesce(low, cfg.options.max_write_bytes)
    step("schedule")
    sched = schedule(low, topo, cfg.options.max_write_bytes, n_regions)
    regions = rank_regions(src_layout, dst_layout, low.staging)
    nic = _nic_stats(topo, low.w_src_rank, low.w_dst_rank, low.w_nbytes.astype(np.float64))
    egress = [n["bytes_out"] for n in nic["nics"] if n["bytes_out"]]
    nic["egress_bound_max_over_mean"] = float(bound / (sum(egress) / len(egress))) \
        if egress else 1.0
    header = plan_header(cfg, spec, topo, dst_layout.replicas, low, nic, int(len(chunks)),
                         unit_max, _fingerprint(spec, src, dst, regions, topo, cfg), VERSION)
    idents = rank_identities(cfg, src_layout, dst_layout).get("identities", ())
    header = dataclasses.replace(
        header, identities=tuple(idents),
        derived=tuple(tuple(d) for d in derived(dst_layout, src_layout.world, cfg.target)))
    step("emit")
    plan = emit(header, low, sched, topo, regions, explain, tuple(names),
                coverage_table(dst_layout, src_layout.world))
    return with_rank_tensors(plan, spec, (src, full_dst), (src_layout, dst_layout))


def compile_file(config_path: str, out_path: str, progress=None,
                 sign_key: str | bytes | None = None) -> dict[str, Any]:
    """Load, check and compile a YAML config; write the plan (signed with `sign_key`, a key
    or the path of a key file, when given). Returns summary stats."""
    from planner.validate import load

    t0 = time.perf_counter()
    cfg, spec = load(config_path)
    return compile_to(cfg, spec, out_path, progress, t0, sign_key)


def compile_to(cfg: Config, spec: ModelSpec, out_path: str, progress=None,
               t0: float | None = None, sign_key: str | bytes | None = None) -> dict[str, Any]:
    """Compile a loaded, checked config (`planner.validate.load`) and write the plan (signed
    with `sign_key` when given). Returns the header's stats with the plan's size, the seconds
    taken and its fingerprint."""
    t0 = time.perf_counter() if t0 is None else t0
    key = None if sign_key is None else plan_key(sign_key)  # a bad key fails first
    plan = compile_config(cfg, spec, progress)
    size = write_plan(out_path, plan, key)
    stats = dataclasses.asdict(plan.header.stats)
    stats.update(plan_bytes=size, seconds=round(time.perf_counter() - t0, 3),
                 fingerprint=plan.header.fingerprint)
    return stats
