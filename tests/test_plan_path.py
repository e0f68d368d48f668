"""The plan path from `executor.load`, traced at run time (the static rules are
tests/test_structure.py's): loading a rank of a small compiled plan enters each plan-reading
function once, not once per layer it passes through.

Every rank of a compiled plan (FSDP2 -> SGLang TP 2, tiny Qwen3) is loaded on its own thread
(`local` transport); a profiler counts, per thread, the calls into the functions that open
the file, read and check the header, and read and decode the rank's part. Each must be
entered exactly once per rank; the header's decode (`PlanHeader.decode`, cached by digest
in the process) at most once. A chunked plan (`load_chunks`) opens the file once and reads
each chunk's header and the rank's part of it once.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from types import CodeType

import executor
import schemas.chunked_plan
import schemas.plan
import schemas.safe_read
from executor.chunked import load_chunks
from executor.transports.local import Fabric
from harness.weights import materialize, random_full_tensors
from planner.compiler import compile_to
from planner.frameworks import build_layout
from planner.spec import spec_from_hf
from planner.validate import validate
from schemas.config_load import config_from_dict
from schemas.header import PlanHeader
from tests.support.models import qwen3
from tests.support.threads import together

HF = qwen3(num_hidden_layers=2)
SOURCE = {"framework": "fsdp2", "dp": 1, "dtype": "float32"}
TARGET = {"engine": "sglang", "tp": 2, "dtype": "float32"}

ONCE: dict[str, Callable] = {
    "open_regular": schemas.safe_read.open_regular,
    "read_header": schemas.plan.read_header,
    "read_rank": schemas.plan.read_rank,
    "read_blob": schemas.plan.read_blob,
    "RankPlan.decode": schemas.plan.RankPlan.decode,
}
"""The plan-reading functions one rank's load enters once (per chunk: all but the open)."""
AT_MOST_ONCE: dict[str, Callable] = {"PlanHeader.decode": PlanHeader.decode}
TRACED: dict[CodeType, str] = {f.__code__: n for n, f in (ONCE | AT_MOST_ONCE).items()}


def _compiled(tmp_path, shadow: dict | None = None) -> tuple[str, list[dict]]:
    spec = spec_from_hf(HF)
    target = TARGET if shadow is None else dict(TARGET, shadow=shadow)
    cfg = config_from_dict({"model": {"config": "x"}, "source": SOURCE, "target": target})
    validate(cfg, spec)
    path = str(tmp_path / "p.rplan")
    compile_to(cfg, spec, path)
    layouts = [build_layout(spec, c, HF) for c in (cfg.source, cfg.target)]
    full = random_full_tensors(spec, seed=1)
    src, dst = materialize(layouts[0], full), materialize(layouts[1], full)
    return path, [src[0], dst[0], dst[1]]


def _traced_loads(load: Callable[[int], object], ranks: int
                  ) -> tuple[dict[int, Counter], list[object]]:
    """`load(rank)` for every rank on its own thread; per rank, the traced calls made."""
    counts: dict[int, Counter] = {r: Counter() for r in range(ranks)}

    def traced(rank: int) -> object:
        def profile(frame, event, _arg):  # noqa: ANN001 - sys.setprofile's signature
            if event == "call" and (name := TRACED.get(frame.f_code)) is not None:
                counts[rank][name] += 1
        sys.setprofile(profile)  # this thread's only
        try:
            return load(rank)
        finally:
            sys.setprofile(None)
    return counts, together(lambda r=r: traced(r) for r in range(ranks))


def _check(counts: Counter, parts: int, rank: int) -> None:
    want = {n: parts for n in ONCE} | {"open_regular": 1}
    got = {n: counts[n] for n in ONCE}
    assert got == want, f"rank {rank}: {got}, want {want}"
    assert counts["PlanHeader.decode"] <= parts, (rank, counts)


def test_executor_load_reads_the_plan_once_per_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    path, tensors = _compiled(tmp_path)
    fabric = Fabric()
    counts, plans = _traced_loads(lambda r: executor.load(
        path, r, tensors[r], transport="local", rendezvous=fabric, no_identity=True,
        timeout_s=20), len(tensors))
    try:
        for r, c in counts.items():
            _check(c, 1, r)
    finally:
        for p in plans:
            p.close()


def test_load_chunks_reads_each_chunk_once(tmp_path, monkeypatch):
    monkeypatch.delenv("RDMA_PLAN_SECRET", raising=False)
    path, tensors = _compiled(tmp_path, {"budget_bytes": 8192})
    chunks = len(schemas.chunked_plan.load_chunked(path)[1])
    fabric = Fabric()

    def load(r: int) -> object:
        if r == 0:
            return load_chunks(path, 0, tensors[0], transport="local", rendezvous=fabric,
                               no_identity=True, timeout_s=20)
        return executor.ChunkedShadow.load(path, r, tensors[r], transport="local",
                                           rendezvous=fabric, no_identity=True,
                                           timeout_s=20)
    counts, loaded = _traced_loads(load, len(tensors))
    try:
        assert chunks >= 3
        for r, c in counts.items():
            _check(c, chunks, r)
    finally:
        for ex in loaded[0]:
            ex.close()
        for s in loaded[1:]:
            s.close()
