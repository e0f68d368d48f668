"""The compiler: a config -> a plan, through the passes, each a pure function.

`compile_to` (what `rdma-plan compile` runs) takes a config and its model spec, both checked
(`planner.validate.load`: pass 1), and writes what `compile_config` returns.
`compile_config` builds both sides' layouts (pass 2) and runs `compile_layouts`, passes
3-13, on them, one numbered step each:

 1. spec: HF `config.json` -> the logical tensors (`planner/spec.py`, `planner/models/`)
 2. layouts: every rank's physical tensors, both sides (`planner/frameworks.py`,
    `planner/layouts/`; a vLLM target traced from the engine's loader begun first, run
    while the source is built)
 3. topology and piece tables: where every plan rank sits (`planner/topology.py`), every
    piece of both sides as columns (`passes/intersect.py`)
 4. route: which target boxes go direct, which are gathered first (`passes/route.py`)
 5. intersect: target pieces x source pieces, the direct path's chunks, rows split to
    `max_write_bytes` (`passes/intersect.py`, `passes/assign.py`)
 6. assign: the source replica of every chunk (`passes/assign.py`)
 7. lower: the direct path's byte runs, packs and unpacks through staging
    (`passes/lower.py`)
 8. gather: the gather path, QUANTs for FP8 and fine-cut boxes (`passes/gather.py`)
 9. merge and coalesce: both paths as one set of ops, adjacent writes joined
    (`passes/lower.py`, `passes/coalesce.py`)
10. schedule: batches, signals and the stage DAG (`passes/schedule.py`)
11. header: staging regions, NIC stats, the fingerprint, identities, derived state
    (`planner/nic_stats.py`, `passes/emit.py`, `planner/identities.py`, `planner/derived.py`)
12. emit: each rank's blob, its tables in scheduled order (`passes/emit.py`)
13. shadow, only with `target.shadow`: each target rank's shadow section
    (`passes/shadow.py`)

A chunked config (`target.shadow: {budget_bytes: N}`, N > 0) takes one more step on the
same layouts, `compile_chunks`: the target's tensors cut into chunks of at most N bytes
(`passes/chunked.py`), passes 3-12 run on each chunk's part of the target layout, and each
chunk plan given its chunked shadow section; `compile_to` writes the chunk plans in one
file (`schemas/chunked_plan.py`). Everything the plan depends on (spec, both layouts,
topology, options) goes into its fingerprint; nothing that varies between runs (time,
paths) goes into the file, so compiling the same config twice gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from planner.collector import gc_paused, release_free
from planner.derived import derived
from planner.fp8 import with_scales
from planner.frameworks import build_layout, start_layout
from planner.identities import rank_identities, rank_tensor_blobs
from planner.layouts.base import Layout
from planner.layouts.traced import model_hf, uses_trace
from planner.nic_stats import egress_bound, egress_sets, nic_stats, pair_bytes, remote_egress
from planner.passes.assign import assign, split_rows
from planner.passes.chunked import chunk_names, only_tensors, with_chunk_shadow
from planner.passes.coalesce import coalesce
from planner.passes.emit import (
    coverage_table,
    emit,
    plan_header,
    rank_regions,
    tensor_regions,
    with_staging,
)
from planner.passes.explain import explain_rows, explain_with
from planner.passes.gather import gather
from planner.passes.intersect import (
    Chunks,
    PieceTable,
    Repeated,
    alike,
    element_size,
    first_block,
    intersect,
    piece_table,
    repeat_block,
    table_and_boxes,
    without_holders,
)
from planner.passes.lower import lower, merge
from planner.passes.lower_cols import chosen
from planner.passes.route import gathered_only, route
from planner.passes.schedule import schedule
from planner.passes.shadow import with_shadow
from planner.placement import plan_fingerprint
from planner.spec import ModelSpec
from planner.topology import build_topology
from schemas.chunked_plan import write_chunked
from schemas.config import Config
from schemas.integrity import plan_key
from schemas.plan import Plan, Region
from schemas.plan_write import write_plan

VERSION = "rdma-plan 0.1.0"

Progress = Callable[[str], None]
Compiled = Plan | list[Plan]
"""A plan, or a chunked config's chunk plans in the order they run."""


def compile_config(cfg: Config, spec: ModelSpec, progress: Progress | None = None,
                   on_plan: Callable[[Compiled], None] | None = None, spill: bool = False
                   ) -> Compiled:
    """Compile a checked config and its model spec into a plan, or, for a chunked config
    (`target.shadow: {budget_bytes: N}`, N > 0), into the chunk plans of a chunked shadow in
    the order they run (`compile_chunks`), from the same layouts. A target traced from vLLM
    for a family with hand-written rules is compiled with the rules' layout while the trace
    runs; that plan is kept only if the trace equals the rules piece for piece (the plan of
    equal layouts is the same bytes), else the traced layout is compiled
    (`planner/layouts/trace_ahead.py`). `on_plan` is called with each plan as soon as it
    is compiled (a guessed one before the trace confirms it, so that writing it overlaps
    the trace): the last call's plan is the one returned. Python's cycle collector is
    paused meanwhile (`gc_paused`). `spill`: the plans' `tensors/<rank>` blobs
    hold their piece columns as memoryviews of a mapped temporary file, not bytes
    (`rank_tensor_blobs`; for a caller that writes the plans and drops them)."""
    with gc_paused():
        return _compile_config(cfg, spec, progress, on_plan or _ignore, spill)


def _compile_config(cfg: Config, spec: ModelSpec, progress: Progress | None,
                    on_plan: Callable[[Compiled], None], spill: bool) -> Compiled:
    if progress is not None:
        progress("layouts")
    hf = model_hf(cfg) if uses_trace(spec, cfg.target) else None
    with start_layout(spec, cfg.target, hf) as target:  # a trace not cached starts now
        src_layout = build_layout(spec, cfg.source)
        if cfg.target.dtype == "fp8_block128":
            spec = with_scales(spec)
        src = piece_table(src_layout, spec, 0)  # while the target is traced
        src_regions = tensor_regions(src_layout)
        # the hand-written layout the trace should equal, if any (chunks are cut from the
        # layout the trace gives)
        guess = None if chunk_budget(cfg) else target.guess()
        if guess is not None:
            plan = _compile_guessed(cfg, spec, src_layout, guess, progress, src, src_regions,
                                    spill)
            if not isinstance(plan, BaseException):
                on_plan(plan)
            if target.confirms(guess):  # the trace equals it: `plan` is the traced plan
                if isinstance(plan, BaseException):
                    raise plan
                return plan
            src = src_regions = None  # the traced layout differs: compile it from scratch
        dst_layout = target.result()
    if chunk_budget(cfg):
        plans = compile_chunks(cfg, spec, src_layout, dst_layout, progress, spill)
        on_plan(plans)
        return plans
    plan = compile_layouts(cfg, spec, src_layout, dst_layout, progress, src, src_regions,
                           spill)
    on_plan(plan)
    return plan


def chunk_budget(cfg: Config) -> int:
    """The bytes of a chunked shadow's buffer (`target.shadow.budget_bytes`), or 0: the
    config compiles to chunk plans when it is not 0."""
    return 0 if cfg.target.shadow is None else cfg.target.shadow.budget_bytes


def compile_chunks(cfg: Config, spec: ModelSpec, src_layout: Layout, dst_layout: Layout,
                   progress: Progress | None = None, spill: bool = False) -> list[Plan]:
    """The chunk plans of a chunked shadow, in the order they run: the target's tensors cut
    into chunks that fit the budget (`planner/passes/chunked.py`), each chunk compiled by
    `compile_layouts` with the target layout restricted to its tensors, then given its
    chunked shadow section."""
    budget = chunk_budget(cfg)
    plain = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, shadow=None))
    chunks = chunk_names(tensor_regions(dst_layout), budget)
    plans = []
    for k, names in enumerate(chunks):
        if progress is not None:
            progress(f"chunk {k + 1} of {len(chunks)}")
        plan = compile_layouts(plain, spec, src_layout, only_tensors(dst_layout, names),
                               spill=spill)
        plans.append(with_chunk_shadow(plan, budget))
    return plans


def _compile_guessed(cfg: Config, spec: ModelSpec, src_layout: Layout, guess: Layout,
                     progress: Progress | None, src: PieceTable,
                     src_regions: list[tuple[Region, ...]], spill: bool) -> Plan | Exception:
    """The plan with the target layout a trace under way is expected to equal, or its
    error (raised only if the trace confirms the guess: the same layout fails the same)."""
    try:
        return compile_layouts(cfg, spec, src_layout, guess, progress, src, src_regions,
                               spill)
    except Exception as e:  # noqa: BLE001 (kept for after the trace: see above)
        return e


def compile_layouts(cfg: Config, spec: ModelSpec, src_layout: Layout, dst_layout: Layout,
                    progress: Progress | None = None, src: PieceTable | None = None,
                    src_regions: list[tuple[Region, ...]] | None = None, spill: bool = False
                    ) -> Plan:
    """Compile two given layouts (the rest of `cfg`: cluster, options) through passes 3-13 of
    the module docstring, one numbered step each. `src`, `src_regions`: the
    source's piece table and tensor regions, when already built (while a target is traced).
    Memory holds one pass's columns, not every pass's: what later steps need of the chunks
    (their explain rows, the egress bound's holder sets, the fingerprint) is taken right
    after assign, and the chunks are dropped once lowered; what they need of the target
    pieces (the coverage table, the tensors blobs) before lower, and all but the gathered
    ones are dropped once lowered, those once gather has taken the rows it reads. The
    fingerprint's digest of the piece tables, the coverage table and the tensors blobs are
    made on a second thread beside assign, done before lower (blake2b and numpy's sorts
    release the GIL). Before each step the heap's free pages go back to the system
    (`collector.release_free`), and once more when the side thread's jobs are done (what
    they freed would otherwise stay resident through lower's peak). `spill`: `compile_config`'s."""
    step, opts, names = _releasing(progress or _quiet), cfg.options, tuple(
        t.name for t in spec.tensors)
    # 3. topology and piece tables
    topo = build_topology(cfg.cluster, src_layout.world, dst_layout.world)
    step("intersect")
    src = piece_table(src_layout, spec, 0) if src is None else src
    dst, dst_boxes = table_and_boxes(dst_layout, spec, src_layout.world)
    # 4. route
    routes = route(spec, src, dst, opts, topo, dst_boxes)
    del dst, dst_boxes  # in `routes`, and dropped with it
    # 5. intersect: where the target's replicas are alike, of the first one's pieces alone
    # (each other's chunks are those, moved), and what the next passes read of the target
    # pieces and chunks held once (`Repeated`: and what the side thread's jobs read, where
    # every target piece is direct)
    pieces, n_alike = routes.direct, alike(routes.direct, dst_layout.replicas)
    one, one_boxes = first_block(pieces, routes.direct_boxes, n_alike) if n_alike else \
        (pieces, routes.direct_boxes)
    chunks = split_rows(intersect(spec, src, one, one_boxes, routes.direct_pairs), one,
                        opts.max_write_bytes)
    del one, one_boxes
    routes = dataclasses.replace(routes, direct_boxes=None, direct_pairs=None)  # read by
    # intersect only
    bytes_in = _bytes_in(routes.targets, topo.world)
    targets = routes.targets
    whole = targets is pieces  # every target piece direct
    routes = gathered_only(routes)  # the target pieces go, but those gather reads
    if n_alike:
        chunks, pieces = repeat_block(chunks, pieces, dst_layout.replicas)
    targets = pieces if whole else targets
    regions = rank_regions(tensor_regions(src_layout) if src_regions is None else src_regions,
                           tensor_regions(dst_layout))  # staging is added once lowered
    side = ThreadPoolExecutor(1)  # hashing and sorts release the GIL: these run beside
    # assign, and are done before lower
    fp_job = side.submit(plan_fingerprint, spec, src, pieces, regions, topo, cfg)
    coverage_job = side.submit(coverage_table, dst_layout, src_layout.world, targets)
    blobs_job = side.submit(rank_tensor_blobs, spec, (src, targets), (src_layout, dst_layout),
                            spill)
    del targets
    # 6. assign
    step("assign")
    choice = assign(chunks, src, pieces, topo)
    n_chunks, sets = len(chunks), egress_sets(chunks, src, pieces, topo)
    chunks = without_holders(chunks)  # read by assign and egress_sets only
    explain = explain_rows(_explain_rows(chunks, choice, src, pieces), n_chunks,
                           replicas=dst_layout.replicas, spill=True)  # read again only
    # when the plan is written
    # 7. lower
    step("lower")
    staging_ids = _staging_ids(src_layout, dst_layout)
    (fp, fp_base), coverage, blobs = fp_job.result(), coverage_job.result(), blobs_job.result()
    side.shutdown()
    release_free()  # what the side thread's jobs freed (in its own arena, after `step`'s trim)
    direct = lower(chunks, choice, src, pieces, staging_ids, opts, names, bytes_in, topo)
    del chunks, choice, pieces  # the largest columns: nothing later reads them
    # 8. gather
    step("gather")
    held = [routes]  # the only reference: gather drops the target pieces once read
    del routes
    more = gather(spec, src, held, staging_ids, opts, topo, direct.stages,
                  remote_egress(topo, direct))
    # 9. merge and coalesce
    parts = [direct, more.lowered]  # merged column by column, each input dropped once used
    del direct
    more = dataclasses.replace(more, lowered=None)
    low = coalesce([merge(parts)], opts.max_write_bytes)  # its input dropped as it goes
    # 10. schedule
    step("schedule")
    sched = schedule(low, topo, opts.max_write_bytes, staging_ids)
    # 11. header
    regions = with_staging(regions, low.staging)
    pairs = pair_bytes(topo, low)  # the writes' sums per rank pair, for both below
    nics = nic_stats(topo, low, egress_bound(sets, topo, more.owner_only), pairs)
    header = plan_header(cfg, spec, topo, dst_layout.replicas, low, nics, n_chunks,
                         more.unit_max, fp, VERSION, pairs)
    del pairs
    header = dataclasses.replace(header, placement_base=fp_base, identities=tuple(
        rank_identities(cfg, src_layout, dst_layout).get("identities", ())), derived=tuple(
        tuple(d) for d in derived(dst_layout, src_layout.world, cfg.target)))
    explain = explain_with(explain, more.explain)
    del more
    # 12. emit
    step("emit")
    ops = [(low, sched)]  # the only reference: emit drops each column it has put in order
    del low, sched
    plan = emit(header, ops, topo, regions, explain, names, coverage)
    # 13. shadow
    if cfg.target.shadow is not None:  # only when asked: other plans keep their bytes
        step("shadow")
        plan = with_shadow(plan, cfg.target.shadow.budget_bytes)
    return dataclasses.replace(plan, extra_blobs=(*plan.extra_blobs, *blobs))


def _quiet(step: str) -> None:
    pass


def _releasing(progress: Progress) -> Progress:
    """`progress`, giving the heap's free pages back first (`collector.release_free`):
    between passes, what the last one dropped is not held through the next one's peak."""

    def step(name: str) -> None:
        release_free()
        progress(name)

    return step


def _ignore(plan: Plan) -> None:
    pass


def _explain_rows(chunks: Chunks, choice: np.ndarray, src: PieceTable, dst: PieceTable
                  ) -> Callable[[slice], tuple[np.ndarray, ...]]:
    """The explain columns (`explain.explain_table`'s six) of a slice of the chunks, made when
    asked for: a replica's block at a time, never all chunks' at once."""

    c = chosen(chunks, choice, src, dst)

    def rows(at: slice) -> tuple[np.ndarray, ...]:
        a = c.at(at)
        return (c.chunk("tensor", a), c.source("rank", a), c.source("region", a),
                c.target("rank", a), c.target("region", a),
                c.chunk("size0", a) * c.chunk("size1", a) * element_size(c.target("dtype", a)))

    return rows


def _bytes_in(t: PieceTable, world: int) -> np.ndarray:
    """Bytes each plan rank receives in the whole plan (both paths), summed a block of
    pieces at a time (whole bytes in float64: exact in any order). Where the pieces are
    `Repeated` copies of alike replicas, of the first copy alone: each other copy's bytes
    are its, the ranks moved by the copy's step."""
    cols = (t.rank, t.size0, t.size1, t.dtype)
    rank = t.rank
    if isinstance(rank, Repeated) and rank.step >= 0 and all(
            isinstance(c, Repeated) and c.times == rank.times and (c is rank or not c.step)
            for c in cols):
        one = _bytes_of(*(c.one for c in cols), world)  # type: ignore[attr-defined]
        out = np.zeros(world, dtype=np.int64)
        for k in range(rank.times):
            shift = k * rank.step
            if shift < world:
                out[shift:] += one[:world - shift]
        return out
    return _bytes_of(*cols, world)


def _bytes_of(rank: np.ndarray, size0: np.ndarray, size1: np.ndarray, dtype: np.ndarray,
              world: int) -> np.ndarray:
    """`_bytes_in` of these columns of the pieces."""
    out = np.zeros(world)
    for lo in range(0, len(rank), 1 << 21):
        at = slice(lo, lo + (1 << 21))
        out += np.bincount(rank[at], weights=size0[at] * size1[at] * element_size(dtype[at]),
                           minlength=world)
    return out.astype(np.int64)


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
    """Compile a loaded, checked config (`planner.validate.load`) and write the plan, or the
    chunk plans of a chunked config in one file (`schemas/chunked_plan.py`), signed with
    `sign_key` when given. Returns the header's stats (a chunked plan's: its budget, its
    chunks and their bytes) with the file's size, the seconds taken and the fingerprint."""
    t0 = time.perf_counter() if t0 is None else t0
    key = None if sign_key is None else plan_key(sign_key)  # a bad key fails first
    tmp, sizes = f"{out_path}.{os.getpid()}.compiling", []

    def write(out: Compiled) -> None:
        if isinstance(out, Plan):
            sizes.append(write_plan(tmp, out, key))
        else:
            sizes.append(write_chunked(tmp, out, chunk_budget(cfg), key))

    try:  # written as soon as compiled (`compile_config`), in place once it is the plan;
        # the plan's stats taken and the plan dropped before the cycle collector is back on
        # (its millions of objects go by their counts, not traversed by a full collection)
        with gc_paused():
            out = compile_config(cfg, spec, progress, write, spill=True)
            os.replace(tmp, out_path)
            stats = _stats(cfg, out, sizes[-1], round(time.perf_counter() - t0, 3))
            del out
    finally:  # nothing left behind on failure: ours, nor `write_plan`'s own PATH.tmpPID
        for left in (tmp, f"{tmp}.tmp{os.getpid()}"):
            if os.path.exists(left):
                os.remove(left)
    return stats


def _stats(cfg: Config, out: Compiled, size: int, seconds: float) -> dict[str, Any]:
    """`compile_to`'s summary of the plan (or chunk plans) `out`, written in `size` bytes."""
    if not isinstance(out, Plan):
        return {"chunked_budget": chunk_budget(cfg), "chunks": len(out),
                "bytes": sum(p.header.stats.bytes for p in out), "plan_bytes": size,
                "seconds": seconds}
    stats = dataclasses.asdict(out.header.stats)
    stats.update(plan_bytes=size, seconds=seconds, fingerprint=out.header.fingerprint)
    return stats
