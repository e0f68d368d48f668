"""The GPU refit benchmark's FP8 check (`bench.gpu_refit.weights.check_fp8`) on CPU: a
block-FP8 plan run with the benchmark's generated weights passes it, and a flipped FP8 byte
or scale fails it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.gpu_refit.weights import check_targets, generate
from harness.weights import DTYPES
from planner.compiler import compile_layouts
from planner.fp8 import quantize_layout, with_scales
from planner.layouts.base import Layout
from planner.spec import ModelSpec, spec_from_hf
from schemas.plan_write import write_plan
from tests.support.synthetic import FP8_HF, fp8_config, fused_col_split, row_split

pytestmark = pytest.mark.slow  # ~20 s quiet: a compile and a 7-rank FP8 run on the CPU


def _run_locally(path: str, spec: ModelSpec, src: Layout, dst: Layout,
                 seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Plan `path` run in this process, every source rank of layout `src` holding the
    benchmark's generated weights of `seed`, every target rank of `dst` zeros: each target's
    tensors after it, by its rank in `dst`."""
    import executor

    tensors = {}
    for rl in src.ranks:
        tensors[rl.rank] = {pt.name: torch.empty(pt.shape, dtype=DTYPES[pt.dtype])
                            for pt in rl.tensors}
        generate(tensors[rl.rank], rl, spec, seed=seed)
    n = len(src.ranks)
    for rl in dst.ranks:
        tensors[n + rl.rank] = {pt.name: torch.zeros(pt.shape, dtype=DTYPES[pt.dtype])
                                for pt in rl.tensors}
    executor.run_all_local(path, tensors)
    return {rl.rank: tensors[n + rl.rank] for rl in dst.ranks}


def test_fp8_check_passes_the_executor_and_catches_a_flip(tmp_path) -> None:
    spec = spec_from_hf(FP8_HF)
    src, dst = row_split(spec, 3), quantize_layout(fused_col_split(spec, 2, 2), spec)
    path = str(tmp_path / "p.rplan")
    write_plan(path, compile_layouts(fp8_config(), with_scales(spec), src, dst))
    got = _run_locally(path, spec, src, dst, seed=3)
    counts = {"cpu_budget": 1 << 14}  # some pieces on the "CPU" path, the rest not
    for rl in dst.ranks:
        assert check_targets(got[rl.rank], rl, spec, 3, counts) == []
    assert counts["cpu"] > 0 and counts["gpu"] > 0
    rl = dst.ranks[1]
    mine = got[1]
    name = next(pt.name for pt in rl.tensors if pt.dtype == "float8_e4m3fn")
    for victim in (name, name + "_scale_inv"):
        raw = mine[victim].view(torch.uint8).view(-1)
        raw[0] ^= 1
        assert check_targets(mine, rl, spec, 3) == [name], victim
        raw[0] ^= 1
    assert check_targets(mine, rl, spec, 4) != []  # another seed's weights differ


def test_megatron_qkv_rows_quantized_in_place_part_by_part_are_bit_exact(tmp_path) -> None:
    """Megatron keeps q, k and v rows per KV group ([q_g; k_g; v_g]), so a vLLM q box is
    several block-aligned whole-row parts of one source: QUANTed in place part by part (no
    gather into staging, so the QUANTs may run early), bit-exact against the reference
    quantizer (two groups, head_dim 128: q parts of 256 rows)."""
    from planner.frameworks import build_layout
    from schemas.config import ClusterConfig, Config, ModelConfig, SourceConfig, TargetConfig
    from schemas.plan import QUANT
    from schemas.protocol import Overlap, staging_index

    hf = {**FP8_HF, "num_attention_heads": 4, "num_key_value_heads": 2}
    spec = spec_from_hf(hf)
    cfg = Config(model=ModelConfig("unused"), source=SourceConfig("megatron"),
                 target=TargetConfig("vllm", dtype="fp8_block128"),
                 cluster=ClusterConfig(placement="colocated", gpus_per_host=2, nics_per_host=2))
    src = build_layout(spec, cfg.source)
    dst = build_layout(spec, cfg.target)
    plan = compile_layouts(cfg, with_scales(spec), src, dst)
    rp = plan.ranks[0]
    c, sg = rp.copies, staging_index(rp)
    q = c["kind"] == QUANT
    assert not (q & (c["src_region"] == sg)).any()  # every QUANT reads a tensor in place
    assert q.sum() > len([t for t in spec.tensors if len(t.shape) == 2
                          and "norm" not in t.name and "embed" not in t.name
                          and "lm_head" not in t.name])  # some box in several parts
    assert Overlap(rp).prepacked[np.unique(c["stage"][q])].all() \
        or len(np.unique(c["stage"][q])) == 1
    path = str(tmp_path / "p.rplan")
    write_plan(path, plan)
    got = _run_locally(path, spec, src, dst, seed=5)
    for rl in dst.ranks:
        assert check_targets(got[rl.rank], rl, spec, 5, {"cpu_budget": 1 << 30}) == []
