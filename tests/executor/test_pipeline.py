"""`executor/pipeline.py`: a stage's packs in groups, each write after every group that
writes a byte it reads; checked against a brute-force footprint test on compiled FP8 plans,
and bit-exact end to end (the local transport runs the groups)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from executor.pipeline import SHARES, groups, split
from planner.compiler import compile_layouts
from planner.fp8 import quantize_layout, with_scales
from planner.spec import spec_from_hf
from schemas.plan import COPY_COLUMNS, PACK, QUANT
from schemas.protocol import copy_footprint
from schemas.table import Table
from tests.support.synthetic import FP8_HF, fp8_config, fused_col_split, row_split


@pytest.fixture(scope="module")
def plan():
    spec = spec_from_hf(FP8_HF)
    src, dst = row_split(spec, 3), quantize_layout(fused_col_split(spec, 2, 2), spec)
    return compile_layouts(fp8_config(), with_scales(spec), src, dst)


@pytest.fixture(scope="module")
def reused():
    """The same with 1 MiB of staging: 13 stages, the rounds reuse their staging bytes."""
    spec = spec_from_hf(FP8_HF)
    src, dst = row_split(spec, 3), quantize_layout(fused_col_split(spec, 2, 2), spec)
    return compile_layouts(fp8_config(staging_bytes=1 << 20), with_scales(spec), src, dst)


def stage_rows(rp, s):
    c, b = rp.copies, rp.batches
    packing = np.flatnonzero((c["stage"] == s) & ((c["kind"] == PACK) | (c["kind"] == QUANT)))
    writes = np.concatenate([np.arange(int(b["start"][i]), int(b["stop"][i]))
                             for i in np.flatnonzero(b["stage"] == s)] or [np.zeros(0, int)])
    return packing, writes


def brute_dep(rp, group_rows, writes):
    """Per write, the last group writing a byte it reads (-1: none), one pair at a time."""
    w = rp.writes
    dep = np.full(len(writes), -1)
    for g, rows in enumerate(group_rows):
        _, reg, lo, hi = copy_footprint(rp, "dst", rows)
        for k, i in enumerate(writes.tolist()):
            a = int(w["src_offset"][i])
            b = a + int(w["nbytes"][i])
            same = reg == int(w["src_region"][i])
            if ((lo[same] < b) & (hi[same] > a) & (b > a)).any():
                dep[k] = g
    return dep


def test_groups_cover_the_copies_and_every_write_follows_what_it_reads(plan):
    pipelined = 0
    for rp in plan.ranks:
        for s in range(rp.stages):
            packing, writes = stage_rows(rp, s)
            for n in range(1, len(SHARES) + 1):
                cut = split(rp, packing, writes, n)
                if cut is None:
                    continue
                pipelined += 1
                group_rows, dep = cut
                assert 1 <= len(group_rows) <= n
                assert all(len(g) for g in group_rows)
                together = np.sort(np.concatenate(group_rows))
                assert np.array_equal(together, np.unique(packing))
                np.testing.assert_array_equal(dep, brute_dep(rp, group_rows, writes))
    assert pipelined  # the FP8 plan has stages that quantize into staging and write it


def test_a_wrong_dependency_would_be_caught(plan):
    """The brute-force check can fail: moving a dependent write one group earlier differs."""
    for rp in plan.ranks:
        for s in range(rp.stages):
            packing, writes = stage_rows(rp, s)
            cut = split(rp, packing, writes, 2)
            if cut is not None and (cut[1] >= 0).any():
                group_rows, dep = cut
                bad = dep.copy()
                bad[np.argmax(dep)] -= 1
                assert not np.array_equal(bad, brute_dep(rp, group_rows, writes))
                return
    pytest.fail("no pipelined stage")


def test_a_stage_whose_copies_read_each_other_stays_whole(plan):
    """Two copies where the second reads what the first writes: never split."""
    for rp in plan.ranks:
        for s in range(rp.stages):
            packing, writes = stage_rows(rp, s)
            if split(rp, packing, writes) is None:
                continue
            c = rp.copies
            q, other = packing[0], packing[1]
            cols = {k: c[k].copy() for k, _ in COPY_COLUMNS}
            for k in ("region", "offset", "dtype"):  # `other` reads exactly what `q` writes
                cols[f"src_{k}"][other] = c[f"dst_{k}"][q]
            bad = replace(rp, copies=Table.build(COPY_COLUMNS, **cols))
            assert split(bad, packing, writes) is None
            return
    pytest.fail("no pipelined stage")


def test_group_count_fits_the_write_window(plan):
    rp = next(r for r in plan.ranks if len(r.writes))
    s = int(rp.batches["stage"][0])
    assert groups(rp, s, 0, 8) == 0
    assert 1 <= groups(rp, s, 4, 8) <= 4
    assert groups(rp, s, 4, 1) == 1


@pytest.mark.extended  # 7 NIXL processes on the CPU: ~1 minute on a quiet 2-core box
def test_fp8_over_nixl_in_groups_is_bit_exact(tmp_path, reused):
    """NIXL posts wait on the host for each group's copies (no `ordered_posts`): the
    grouped stages of the FP8 plan still land bit-exact against the reference quantizer."""
    pytest.importorskip("nixl")
    import os
    import secrets
    import sys

    from harness.launch import master_store, root_env, spawn_ranks
    from schemas.plan_write import write_plan

    path = str(tmp_path / "p.rplan")
    write_plan(path, reused)
    world = len(reused.ranks)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_worker.py")
    store, port = master_store(60)  # noqa: F841 (alive while the ranks run)
    done = spawn_ranks(lambda r: [sys.executable, worker, path, str(r), f"127.0.0.1:{port}",
                                  str(world), "4"], world,
                       env=root_env(NIXL_LOG_LEVEL="WARN",
                                    RDMA_PLAN_SECRET=secrets.token_hex(32)), timeout=300)
    for f in done:
        assert f.returncode == 0, f"rank {f.rank} failed:\n{f.output[-3000:]}"
    outs = "".join(f.output for f in done)
    assert outs.count("bit-exact") == world - 3
    grouped = [int(line.split()[-1]) for line in outs.splitlines() if " pipelined " in line]
    assert len(grouped) == 3 and sum(grouped) > 0


class _Handles:
    """A transport that only hands back its batches (link reads the batches, not handles)."""

    from executor.transports.base import Capabilities
    capabilities = Capabilities()

    def prepare(self, batch):
        return batch


def test_each_group_waits_for_exactly_the_earlier_batches_reading_what_it_writes(reused):
    import torch

    from executor.pipeline import link
    from executor.stages import prepare_stage

    checked = 0
    for rp in reused.ranks:
        regions = [torch.zeros(r.nbytes, dtype=torch.uint8) for r in rp.regions]
        stages = [prepare_stage(rp, s, regions, _Handles(), groups(rp, s, 4, 8))
                  for s in range(rp.stages)]
        link(rp, stages)
        posted = []  # (entry, read intervals) in posting order
        for st in stages:
            parts = st.pipeline or [([], st.batches)]
            for k, (_, entries) in enumerate(parts):
                if st.pipeline:
                    want = set()
                    if k > 0:
                        _, reg, lo, hi = copy_footprint(rp, "dst", st.group_rows[k - 1])
                        for e in posted:
                            b = e.batch
                            for r, o, n in zip(b.src_region, b.src_offset, b.nbytes):
                                same = reg == r
                                if ((lo[same] < o + n) & (hi[same] > o) & (n > 0)).any():
                                    want.add(id(e))
                    assert st.blocked[k] == frozenset(want)
                    checked += bool(want)
                posted += entries
    assert checked  # some group waits for an earlier stage's writes


@pytest.mark.slow  # a 7-rank FP8 run on the CPU
def test_fp8_in_groups_with_reused_staging_is_bit_exact_locally(reused, tmp_path):
    import torch

    import executor
    from bench.gpu_refit.weights import check_targets, generate
    from harness.weights import DTYPES
    from schemas.plan_write import write_plan

    spec = spec_from_hf(FP8_HF)
    src, dst = row_split(spec, 3), quantize_layout(fused_col_split(spec, 2, 2), spec)
    path = str(tmp_path / "p.rplan")
    write_plan(path, reused)
    n = len(src.ranks)
    tensors = {}
    for r, rl in enumerate([*src.ranks, *dst.ranks]):
        tensors[r] = {pt.name: torch.zeros(pt.shape, dtype=DTYPES[pt.dtype])
                      for pt in rl.tensors}
        if r < n:
            generate(tensors[r], rl, spec, seed=5)
    executor.run_all_local(path, tensors)
    for rl in dst.ranks:
        assert check_targets(tensors[n + rl.rank], rl, spec, 5) == []


def test_writes_in_flight_beside_early_quants_are_beside_packs(reused):
    """`beside_quants`: the stages whose writes may be in flight while a later stage's
    QUANTs run early (stage s's during stage s-1: the writes of s-1 and s-2), against the
    rule written out per stage; `prepare_stage(beside=True)` makes every batch of a stage
    `beside_packs`, grouped or not (else only the groups before the last are)."""
    import torch

    from executor.pipeline import beside_quants
    from executor.stages import prepare_stage

    rp = reused.ranks[0]
    quant = set(rp.copies["stage"][rp.copies["kind"] == QUANT].tolist())
    for pre in ([False] * rp.stages, [s in quant for s in range(rp.stages)],
                [s % 4 == 2 for s in range(rp.stages)]):
        got = beside_quants(rp, pre)
        want = [any(k < rp.stages and pre[k] and k in quant for k in (s + 1, s + 2))
                for s in range(rp.stages)]
        assert got == want
    assert any(beside_quants(rp, [s in quant for s in range(rp.stages)]))
    regions = [torch.zeros(r.nbytes, dtype=torch.uint8) for r in rp.regions]
    grouped = next(s for s in range(rp.stages)
                   if prepare_stage(rp, s, regions, _Handles(), groups(rp, s, 4, 8)).pipeline)
    for beside in (False, True):
        st = prepare_stage(rp, grouped, regions, _Handles(), groups(rp, grouped, 4, 8), beside)
        last = st.pipeline[-1][1]
        assert last and all(e.batch.beside_packs == beside for e in last)
        assert all(e.batch.beside_packs for _, es in st.pipeline[:-1] for e in es)
        whole = prepare_stage(rp, grouped, regions, _Handles(), 0, beside)
        assert whole.batches and all(e.batch.beside_packs == beside for e in whole.batches)
