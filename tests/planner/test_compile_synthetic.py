"""The compiler on hand-built layouts: a row-split source (3 ranks, uneven) into a
fused, column-split target (2 ranks x 2 replicas). Every target box is strided, so the
plan needs row runs, packs and unpacks; fp32 -> bf16 needs casts."""

from __future__ import annotations

import pytest
import torch

from harness.weights import materialize, random_full_tensors
from planner.compiler import compile_layouts
from planner.spec import spec_from_hf
from planner.tools.verify import verify_plan
from schemas.plan import load_plan
from schemas.plan_write import encode_plan, write_plan
from tests.support.synthetic import SMALL_HF as HF
from tests.support.synthetic import fused_col_split, row_split
from tests.support.synthetic import small_config as _config


def _source(kind: str, spec, dtype: str):
    if kind == "rows":  # 3 ranks, rows 34/34/33: every target box is a strided source box
        return row_split(spec, 3, dtype)
    # 4-way column split: a target rank's half-columns come from 2 sources, each landing
    # as a strided quarter inside the target's rows: unpacks on the target.
    return fused_col_split(spec, 4, 1, dtype)


@pytest.mark.parametrize("src_kind,src_dtype,opts", [
    ("rows", "bfloat16", {}),
    ("rows", "bfloat16", {"write_overhead_us": 0.0}),      # all direct row writes
    ("rows", "float32", {"staging_bytes": 8192, "max_write_bytes": 4096}),  # casts, stages
    ("cols", "bfloat16", {}),                                 # unpacks on targets
    ("cols", "bfloat16", {"staging_bytes": 4096, "max_write_bytes": 4096}),  # ACKed stages
    ("cols", "float32", {"pack_overhead_us": 0.0}),           # cast + unpack
])
def test_compiled_plan_reproduces_targets(tmp_path, src_kind, src_dtype, opts):
    executor = pytest.importorskip("executor")
    spec = spec_from_hf(HF)
    src, dst = _source(src_kind, spec, src_dtype), fused_col_split(spec, 2, 2)
    plan = compile_layouts(_config(**opts), spec, src, dst)
    stats = plan.header.stats
    if src_kind == "cols" and opts.get("write_overhead_us", 2.0) > 0:
        assert stats.unpacks > 0
    if src_dtype == "float32":
        assert stats.packs > 0
    assert verify_plan(plan) == []
    path = str(tmp_path / "p.rplan")
    write_plan(path, plan)
    assert encode_plan(load_plan(path)) == encode_plan(plan)
    full = random_full_tensors(spec, seed=1)
    if src_dtype == "float32":  # values that bf16 cannot hold exactly: the cast matters
        full = {k: v.float() + 1e-3 * torch.randn_like(v.float()) for k, v in full.items()}
    tensors = materialize(src, full)
    expect = materialize(dst, full)
    n_src = len(src.ranks)
    for r, t in materialize(dst, {k: torch.zeros_like(v) for k, v in full.items()}).items():
        tensors[n_src + r] = t
    executor.run_all_local(path, tensors)
    for r, want in expect.items():
        for name, w in want.items():
            assert torch.equal(tensors[n_src + r][name], w), (r, name)


def test_compile_is_deterministic():
    spec = spec_from_hf(HF)
    a = compile_layouts(_config(), spec, row_split(spec, 3), fused_col_split(spec, 2, 2))
    b = compile_layouts(_config(), spec, row_split(spec, 3), fused_col_split(spec, 2, 2))
    assert encode_plan(a) == encode_plan(b)


def test_staging_too_small_is_a_clear_error():
    spec = spec_from_hf(HF)
    with pytest.raises(ValueError, match="options.staging_bytes"):
        compile_layouts(_config(staging_bytes=100), spec, row_split(spec, 3, "float32"),
                        fused_col_split(spec, 2, 1))
