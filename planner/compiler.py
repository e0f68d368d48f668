"""The compiler: a config -> a plan, through the passes, each a pure function.

    layouts -> topology -> piece tables -> route -> intersect -> split rows -> assign
      -> lower -> gather -> merge -> coalesce -> schedule -> NIC stats -> header -> emit

`compile_layouts` is that line, one pass per line; each pass lives in its own module
(`planner/passes/`, `planner/nic_stats.py`). Everything the plan depends on (spec, both
layouts, topology, options) goes into its fingerprint; nothing that varies between runs
(time, paths) goes into the file, so compiling the same config twice gives the same bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from planner.derived import derived
from planner.fp8 import with_scales
from planner.frameworks import build_layout, start_layout
from planner.identities import rank_identities, rank_tensor_blobs
from planner.layouts.base import Layout
from planner.layouts.traced import model_hf, uses_trace
from planner.nic_stats import egress_bound, egress_sets, nic_stats, remote_egress
from planner.passes.assign import assign, split_rows
from planner.passes.coalesce import coalesce
from planner.passes.emit import (
    coverage_table,
    emit,
    explain_table,
    explain_with,
    plan_header,
    rank_regions,
    spilled,
    tensor_regions,
    with_staging,
)
from planner.passes.gather import gather
from planner.passes.intersect import (
    PieceTable,
    chunk_bytes,
    element_size,
    intersect,
    piece_table,
    table_and_boxes,
    without_holders,
)
from planner.passes.lower import lower, merge
from planner.passes.route import gathered_only, route
from planner.passes.schedule import schedule
from planner.passes.shadow import with_shadow
from planner.placement import plan_fingerprint
from planner.spec import ModelSpec
from planner.topology import build_topology
from schemas.config import Config
from schemas.integrity import plan_key
from schemas.plan import Plan, Region
from schemas.plan_write import write_plan

VERSION = "rdma-plan 0.1.0"

Progress = Callable[[str], None]


def compile_config(cfg: Config, spec: ModelSpec, progress: Progress | None = None,
                   on_plan: Callable[[Plan], None] | None = None) -> Plan:
    """Compile a checked config and its model spec into a plan. A target traced from vLLM
    for a family with hand-written rules is compiled with the rules' layout while the trace
    runs; that plan is kept only if the trace equals the rules piece for piece (the plan of
    equal layouts is the same bytes), else the traced layout is compiled
    (`planner/layouts/trace_ahead.py`). `on_plan` is called with each plan as soon as it
    is compiled (a guessed one before the trace confirms it, so that writing it overlaps
    the trace): the last call's plan is the one returned. Python's cycle collector is
    paused meanwhile (`no_cycle_collection`)."""
    with no_cycle_collection():
        return _compile_config(cfg, spec, progress, on_plan or _ignore)


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Pause the cyclic garbage collector (if on), and restart it after. The compiler's data
    are numpy columns and frozen layout objects, freed by reference counting; a compile
    leaves only a few hundred objects in cycles, while the collector's passes over a large
    model's layouts (millions of small objects) cost a visible share of the compile."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _compile_config(cfg: Config, spec: ModelSpec, progress: Progress | None,
                    on_plan: Callable[[Plan], None]) -> Plan:
    if progress is not None:
        progress("layouts")
    hf = model_hf(cfg) if uses_trace(spec, cfg.target) else None
    with start_layout(spec, cfg.target, hf) as target:  # a trace not cached starts now
        src_layout = build_layout(spec, cfg.source)
        if cfg.target.dtype == "fp8_block128":
            spec = with_scales(spec)
        src = piece_table(src_layout, spec, 0)  # while the target is traced
        src_regions = tensor_regions(src_layout)
        guess = target.guess()  # the hand-written layout the trace should equal, if any
        if guess is not None:
            plan = _compile_guessed(cfg, spec, src_layout, guess, progress, src, src_regions)
            if not isinstance(plan, BaseException):
                on_plan(plan)
            if target.confirms(guess):  # the trace equals it: `plan` is the traced plan
                if isinstance(plan, BaseException):
                    raise plan
                return plan
            src = src_regions = None  # the traced layout differs: compile it from scratch
        dst_layout = target.result()
    plan = compile_layouts(cfg, spec, src_layout, dst_layout, progress, src, src_regions)
    on_plan(plan)
    return plan


def _compile_guessed(cfg: Config, spec: ModelSpec, src_layout: Layout, guess: Layout,
                     progress: Progress | None, src: PieceTable,
                     src_regions: list[tuple[Region, ...]]) -> Plan | Exception:
    """The plan with the target layout a trace under way is expected to equal, or its
    error (raised only if the trace confirms the guess: the same layout fails the same)."""
    try:
        return compile_layouts(cfg, spec, src_layout, guess, progress, src, src_regions)
    except Exception as e:  # noqa: BLE001 (kept for after the trace: see above)
        return e


def compile_layouts(cfg: Config, spec: ModelSpec, src_layout: Layout, dst_layout: Layout,
                    progress: Progress | None = None, src: PieceTable | None = None,
                    src_regions: list[tuple[Region, ...]] | None = None) -> Plan:
    """Compile two given layouts (the rest of `cfg`: cluster, options), one pass a line:
    topology, piece tables and tensor regions (`src`, `src_regions`: the source's, when
    already built: while a target is traced), route (direct or
    gather path), intersect and split rows, assign, lower (direct path), gather (FP8 and
    fine-cut boxes), merge and coalesce, schedule, regions, NIC stats, header (the
    fingerprint covers the direct path's target pieces, as it always has), explain, emit.
    What later steps need of the chunks (their explain rows, the egress bound's holder
    sets, the fingerprint) is taken right after assign, and the chunks are dropped once
    lowered; what they need of the target pieces (the coverage table, the tensors blobs)
    before lower, and all but the gathered ones are dropped once lowered: memory holds
    one pass's columns, not every pass's. The fingerprint's digest of the piece tables,
    the coverage table and the tensors blobs are made on a second thread from assign to
    the end of lower (blake2b and numpy's sorts release the GIL)."""
    step, opts, names = progress or _quiet, cfg.options, tuple(t.name for t in spec.tensors)
    topo = build_topology(cfg.cluster, src_layout.world, dst_layout.world)
    step("intersect")
    src = piece_table(src_layout, spec, 0) if src is None else src
    dst, dst_boxes = table_and_boxes(dst_layout, spec, src_layout.world)
    routes = route(spec, src, dst, opts, topo, dst_boxes)
    del dst, dst_boxes  # in `routes`, and dropped with it
    chunks = split_rows(intersect(spec, src, routes.direct, routes.direct_boxes), routes.direct,
                        opts.max_write_bytes)
    routes = dataclasses.replace(routes, direct_boxes=None)  # read by intersect only
    step("assign")
    choice = assign(chunks, src, routes.direct, topo)
    n_chunks, sets = len(chunks), egress_sets(chunks, src, routes.direct, topo)
    chunks = without_holders(chunks)  # read by assign and egress_sets only
    explain = explain_table(chunks.tensor, src.rank[choice], src.region[choice],
                            routes.direct.rank[chunks.dst], routes.direct.region[chunks.dst],
                            chunk_bytes(chunks, routes.direct))
    explain = spilled(explain)  # read again only when the plan is written
    regions = rank_regions(tensor_regions(src_layout) if src_regions is None else src_regions,
                           tensor_regions(dst_layout))  # staging is added once lowered
    side = ThreadPoolExecutor(1)  # hashing and sorts release the GIL: these run beside lower
    fp_job = side.submit(plan_fingerprint, spec, src, routes.direct, regions, topo, cfg)
    coverage_job = side.submit(coverage_table, dst_layout, src_layout.world, routes.targets)
    blobs_job = side.submit(rank_tensor_blobs, spec, (src, routes.targets),
                            (src_layout, dst_layout))
    step("lower")
    staging_ids = _staging_ids(src_layout, dst_layout)
    bytes_in = _bytes_in(routes.targets, topo.world)
    direct = lower(chunks, choice, src, routes.direct, staging_ids, opts, names, bytes_in,
                   topo)
    del chunks, choice  # the largest columns: nothing later reads them
    # before the target pieces they read are dropped
    (fp, fp_base), coverage, blobs = fp_job.result(), coverage_job.result(), blobs_job.result()
    side.shutdown()
    routes = gathered_only(routes)  # the target pieces go, but those gather reads
    step("gather")
    more = gather(spec, src, routes, staging_ids, opts, topo, direct.stages,
                  remote_egress(topo, direct))
    low = coalesce(merge(direct, more.lowered), opts.max_write_bytes)
    del direct
    step("schedule")
    sched = schedule(low, topo, opts.max_write_bytes, staging_ids)
    regions = with_staging(regions, low.staging)
    nics = nic_stats(topo, low, egress_bound(sets, topo, more.owner_only))
    header = plan_header(cfg, spec, topo, dst_layout.replicas, low, nics, n_chunks,
                         more.unit_max, fp, VERSION)
    header = dataclasses.replace(header, placement_base=fp_base, identities=tuple(
        rank_identities(cfg, src_layout, dst_layout).get("identities", ())), derived=tuple(
        tuple(d) for d in derived(dst_layout, src_layout.world, cfg.target)))
    explain = explain_with(explain, more.explain)
    del more
    step("emit")
    plan = emit(header, low, sched, topo, regions, explain, names, coverage)
    if cfg.target.shadow is not None:  # only when asked: other plans keep their bytes
        step("shadow")
        plan = with_shadow(plan, cfg.target.shadow.budget_bytes)
    return dataclasses.replace(plan, extra_blobs=(*plan.extra_blobs, *blobs))


def _quiet(step: str) -> None:
    pass


def _ignore(plan: Plan) -> None:
    pass


def _bytes_in(t: PieceTable, world: int) -> np.ndarray:
    """Bytes each plan rank receives in the whole plan (both paths)."""
    return np.bincount(t.rank, weights=t.size0 * t.size1 * element_size(t.dtype),
                       minlength=world).astype(np.int64)


def _staging_ids(src: Layout, dst: Layout) -> np.ndarray:
    """Region id of each plan rank's staging: it comes after the rank's tensors."""
    return np.array([len(r.tensors) for r in (*src.ranks, *dst.ranks)], dtype=np.int64)


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
    tmp, sizes = f"{out_path}.{os.getpid()}.compiling", []
    try:  # written as soon as compiled (`compile_config`), in place once it is the plan
        plan = compile_config(cfg, spec, progress,
                              lambda p: sizes.append(write_plan(tmp, p, key)))
        os.replace(tmp, out_path)
    finally:  # nothing left behind on failure: ours, nor `write_plan`'s own PATH.tmpPID
        for left in (tmp, f"{tmp}.tmp{os.getpid()}"):
            if os.path.exists(left):
                os.remove(left)
    size = sizes[-1]
    stats = dataclasses.asdict(plan.header.stats)
    stats.update(plan_bytes=size, seconds=round(time.perf_counter() - t0, 3),
                 fingerprint=plan.header.fingerprint)
    return stats
