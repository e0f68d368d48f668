"""`gather_batch.add_rest` (the gather's boxes decided one by one, their rows made as
columns a block at a time) against `Gatherer.add` box by box, the path it stands for: the
same writes, copies, explain rows and bounds, row for row, on configs that take each path
(FSDP2 row gathers with pool-1 packs, Megatron column parts, replicated sources whose
chunks have several holders, a cast, several staging rounds, pools in halves)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from planner import compiler
from planner.passes import gather_batch
from planner.passes.gather import Gatherer
from planner.passes.gather_batch import add_rest
from planner.passes.gather_direct import add_direct
from planner.passes.gather_out import explain_rows, lowered
from planner.spec import load_spec
from schemas.config_load import config_from_dict
from tests.support.models import FP8_DSV3 as DSV3
from tests.support.models import FP8_QWEN as QWEN

FP8 = {"dtype": "fp8_block128"}
CASES = [
    (QWEN, dict(framework="fsdp2", dp=3), dict(engine="vllm", tp=2, **FP8), {}),
    (QWEN, dict(framework="fsdp2", dp=3), dict(engine="vllm", tp=2, replicas=3, **FP8),
     {"staging_bytes": 600_000}),
    (QWEN, dict(framework="fsdp2", dp=3), dict(engine="vllm", tp=2, replicas=2, **FP8),
     {"staging_bytes": 1_000_000}),
    (QWEN, dict(framework="megatron", tp=4), dict(engine="vllm", tp=2, replicas=2, **FP8), {}),
    (QWEN, dict(framework="fsdp2", dp=2, dp_replicate=2), dict(engine="vllm", tp=2, **FP8), {}),
    (QWEN, dict(framework="fsdp2", dp=4, dtype="float32"), dict(engine="vllm", tp=1,
                                                                  replicas=4), {}),
    (DSV3, dict(framework="fsdp2", dp=3, fused_experts=True), dict(engine="vllm", tp=2, **FP8),
     {}),
    (DSV3, dict(framework="fsdp2", dp=4), dict(engine="vllm", tp=2, ep=True, replicas=2, **FP8),
     {"staging_bytes": 2_000_000}),
]


def _inputs(tmp_path, hf, source, target, options) -> list[tuple]:
    """The gather pass's arguments in the compile of a config (the routes in their list)."""
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = config_from_dict({"model": {"config": "config.json"}, "source": source,
                            "target": target, "options": options}, str(tmp_path))
    seen = []
    real = compiler.gather

    def keep(spec, src, held, *rest):
        seen.append((spec, src, held[0], rest))
        return real(spec, src, held, *rest)

    compiler.gather = keep
    try:
        compiler.compile_config(cfg, load_spec(cfg.model_config_path))
    finally:
        compiler.gather = real
    return seen


def _made(spec, src, routes, rest, batch: bool) -> tuple[list[np.ndarray], int, int]:
    """The gather's columns, explain rows and bounds, its boxes after the in-place QUANTs
    made by `add_rest` or by `Gatherer.add` one by one; and how many boxes each took."""
    g = Gatherer(spec, src, [routes], *rest)
    order = np.array(g.order(), dtype=np.int64)
    rest_boxes = order[add_direct(g, order):]
    if batch:
        n = add_rest(g, rest_boxes)
    else:
        n = 0
        for t in rest_boxes.tolist():
            g.add(t)
    low = lowered(g.out, g.alloc, g.max_stage + 1, g.base, g.n_regions)
    cols = [np.asarray(getattr(low, f.name)) for f in dataclasses.fields(low)
            if f.name != "copies"]
    cols += [low.copies[k] for k in sorted(low.copies)]
    cols += [explain_rows(g.out), g.owner_only, np.array([g.unit_max, g.max_stage])]
    return cols, n, len(rest_boxes) - n


@pytest.mark.parametrize("rows", [gather_batch.ROWS, 40])  # one slice a case, or many
def test_add_rest_makes_the_rows_of_add(tmp_path, monkeypatch, rows):
    monkeypatch.setattr(gather_batch, "ROWS", rows)
    as_columns = by_rows = 0
    for k, (hf, source, target, options) in enumerate(CASES):
        path = tmp_path / str(k)
        path.mkdir()
        for spec, src, routes, rest in _inputs(path, hf, source, target, options):
            if not len(routes.gathered):
                continue
            want, _, _ = _made(spec, src, routes, rest, batch=False)
            got, n, m = _made(spec, src, routes, rest, batch=True)
            as_columns, by_rows = as_columns + n, by_rows + m
            assert len(got) == len(want)
            for i, (a, b) in enumerate(zip(got, want)):
                assert a.shape == b.shape and np.array_equal(a, b), (k, i)
    # both paths were taken: the boxes as columns, and those `add` does (several holders)
    assert as_columns > 0 and by_rows > 0


def test_add_rest_of_no_boxes_makes_nothing():
    assert add_rest(None, np.zeros(0, dtype=np.int64)) == 0  # type: ignore[arg-type]


@pytest.mark.parametrize("rows", [3, 7])
def test_block_reserve_keeps_the_rows_in_order(rows):
    from planner.passes.gather_out import Block

    b = Block(2)
    b.reserve(rows)
    b.append((0, 0))
    b.extend(np.array([[1, 1], [2, 2]]))
    b.append((3, 3))
    b.extend(np.array([[4, 4]]))
    got = b.take(1)
    assert got[:5].tolist() == [[i, i] for i in range(5)] and len(got) == 6
    assert len(b) == 0
