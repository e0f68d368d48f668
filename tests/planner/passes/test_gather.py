"""Regressions of the gather pass (`planner/passes/gather.py`) and of the routing that sends
boxes to it (`planner/passes/route.py`), geometry spelled out; found by the property suite
(tests/property/)."""

from __future__ import annotations

import pytest

from planner.compiler import compile_layouts
from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.spec import ModelSpec, spec_from_hf
from planner.tools.verify import verify_plan
from schemas.config import ClusterConfig, Config, ModelConfig, Options, SourceConfig, TargetConfig
from tests.support.synthetic import TINY, whole_tensors


def transposed(spec: ModelSpec, side: str, world: int, replicas: int) -> Layout:
    """Each tensor `torch.chunk`ed by rows over `world` ranks per replica; 2-d boxes are
    stored transposed (`[cols, rows]`, `dims=(1, 0)`)."""
    ranks = []
    for rep in range(replicas):
        for r in range(world):
            tensors = []
            for t in spec.tensors:
                c = -(-t.shape[0] // world)
                lo, hi = min(r * c, t.shape[0]), min((r + 1) * c, t.shape[0])
                if len(t.shape) == 2:
                    tensors.append(PhysicalTensor(t.name, (t.shape[1], hi - lo), "bfloat16", (
                        Piece(t.name, (lo, 0), (hi - lo, t.shape[1]), (0, 0), (1, 0)),)))
                else:
                    tensors.append(PhysicalTensor(t.name, (hi - lo,), "bfloat16", (
                        Piece(t.name, (lo,), (hi - lo,), (0,)),)))
            ranks.append(RankLayout(rep * world + r, rep, tuple(tensors)))
    return Layout(side, "hand", tuple(ranks), replicas)  # type: ignore[arg-type]


@pytest.mark.parametrize("side", ["target"])  # the fuzzer also hit "source" (report)
def test_gather_skips_transposed_boxes(side: str) -> None:
    # 3 bf16 source ranks, each tensor row-split 3/3/2 (torch.chunk of 8 rows), -> 2
    # target replicas of 1 rank holding everything: each target box is cut into c=3
    # chunks and held by h=2 ranks, c*h - c - h = 1 write saved, so `route.fine_cut` chooses to
    # gather it. With the 2-d boxes of one side stored transposed (`side`), gather raises
    # "... transposed ...; gathered boxes must land as rows" / "a gather needs rows" for
    # layouts the direct path handles: such boxes must not be chosen for gathering.
    from tests.support.synthetic import row_split

    spec = spec_from_hf(TINY)
    src = transposed(spec, "source", 3, 1) if side == "source" else row_split(spec, 3)
    dst = transposed(spec, "target", 1, 2) if side == "target" else \
        whole_tensors(spec, "target", "bfloat16", 2)
    cfg = Config(model=ModelConfig("hand"), source=SourceConfig("fsdp2", dp=3),
                 target=TargetConfig("vllm", replicas=2),
                 cluster=ClusterConfig(gpus_per_host=8, nics_per_host=1), options=Options())
    plan = compile_layouts(cfg, spec, src, dst)
    assert verify_plan(plan) == []


def test_gather_takes_single_columns_stored_transposed() -> None:
    # Found by the deep run once hand-built layouts drew transposed boxes again. 3 bf16
    # source ranks, each tensor row-split 3/3/2, -> 2 target replicas of 1 rank holding
    # everything whole, except q_proj.weight [8, 8]: 8 single-column boxes [8 x 1], each
    # stored transposed as its own [1, 8] tensor (dims=(1, 0): a0 = 1, a1 = 8). Each
    # column comes in c=3 chunks to h=2 ranks: c*h - c - h = 1 write saved, so it is
    # gathered. A column is one strided run whatever its stride a1 (lower reads it as one
    # row); gather refused it ("... is transposed on target rank ...; gathered boxes must
    # land as rows") while `route.fine_cut` had rightly let it through.
    from tests.support.synthetic import row_split

    spec = spec_from_hf(TINY)
    q = "model.layers.0.self_attn.q_proj.weight"
    tensors = []
    for t in spec.tensors:
        if t.name != q:
            tensors.append(PhysicalTensor(t.name, t.shape, "bfloat16", (
                Piece(t.name, (0,) * len(t.shape), t.shape, (0,) * len(t.shape)),)))
            continue
        tensors += [PhysicalTensor(f"{q}.col{j}", (1, 8), "bfloat16", (
            Piece(q, (0, j), (8, 1), (0, 0), (1, 0)),)) for j in range(8)]
    dst = Layout("target", "hand", tuple(RankLayout(r, r, tuple(tensors)) for r in range(2)),
                 2)
    cfg = Config(model=ModelConfig("hand"), source=SourceConfig("fsdp2", dp=3),
                 target=TargetConfig("vllm", replicas=2),
                 cluster=ClusterConfig(gpus_per_host=8, nics_per_host=1), options=Options())
    plan = compile_layouts(cfg, spec, row_split(spec, 3), dst)
    assert plan.header.stats.gather_unit_max > 0  # the columns were gathered
    assert verify_plan(plan) == []


def test_gather_staging_pool_of_a_budget_not_a_multiple_of_the_element_size() -> None:
    # Found by the deep run once budgets were drawn off the 64-byte grid again. 3 fp32
    # source ranks, each tensor row-split 3/3/2, every 2-d piece stored with 2 padding
    # columns ([rows, 10]: strided), -> 2 fp32 target replicas of 1 rank holding everything
    # whole: every 8x8 weight (256 bytes) is gathered (c=3 chunks, h=2 ranks). The
    # owner's helpers pack their strided rows into the second pool of their staging, which
    # began at budget - budget // 4 = 5000 - 1250 = 3750 bytes: the PACK got element
    # offset 3750 // 4 = 937 (byte 3748) while the write read from byte 3750, so two bytes
    # of every helper's part were lost.
    from tests.property import harness
    from tests.property.strategies import Case

    spec = spec_from_hf(TINY)
    ranks = []
    for r in range(3):
        tensors = []
        for t in spec.tensors:
            lo, hi = min(3 * r, t.shape[0]), min(3 * r + 3, t.shape[0])
            if len(t.shape) == 2:
                tensors.append(PhysicalTensor(t.name, (hi - lo, t.shape[1] + 2), "float32", (
                    Piece(t.name, (lo, 0), (hi - lo, t.shape[1]), (0, 1)),)))
            else:
                tensors.append(PhysicalTensor(t.name, (hi - lo,), "float32", (
                    Piece(t.name, (lo,), (hi - lo,), (0,)),)))
        ranks.append(RankLayout(r, 0, tuple(tensors)))
    src = Layout("source", "hand", tuple(ranks), 1)
    dst = whole_tensors(spec, "target", "float32", 2)
    cfg = Config(model=ModelConfig("hand"), source=SourceConfig("fsdp2", dp=3, dtype="float32"),
                 target=TargetConfig("vllm", replicas=2, dtype="float32"),
                 cluster=ClusterConfig(gpus_per_host=8, nics_per_host=1),
                 options=Options(staging_bytes=5000))
    case = Case(spec, src, dst, cfg, TINY)
    plan = compile_layouts(cfg, spec, src, dst)
    assert plan.header.stats.gather_unit_max > 0  # the weights were gathered
    assert verify_plan(plan) == []
    full = harness.labels(case)
    assert harness.mismatches(harness.run(plan, case, full), harness.expected(case, full)) == []


def test_gathered_boxes_are_balanced_over_nics_not_ranks() -> None:
    # Found by the fast profile (p6, a replicated qwen3_moe case). An 8-layer llama with
    # 16x16 weights (512 bytes in bf16); 3 source ranks each holding the whole model as
    # row halves (pure data parallelism), 2 GPUs per host and 1 NIC: ranks 0 and 1 share
    # NIC h0/nic0, rank 2 has h1/nic0. 3 target replicas of 1 rank hold everything whole,
    # on other hosts. Every box comes in c=2 chunks to h=3 ranks (1 write saved): all are
    # gathered, each by one owner as one unit (3 x 512 bytes). Owners were balanced over
    # source *ranks*, so NIC h0/nic0 sent 2/3 of everything: ~14 KB above the mean, past
    # the one-unit slack (max_write_bytes 4096) that `verify.balance` allows.
    from planner.tools import verify

    hf = {**TINY, "hidden_size": 16, "head_dim": 16, "intermediate_size": 16,
          "vocab_size": 16, "num_hidden_layers": 8}
    spec = spec_from_hf(hf)
    tensors = []
    for t in spec.tensors:
        half = t.shape[0] // 2
        for i, (lo, n) in enumerate(((0, half), (half, t.shape[0] - half))):
            shape = (n, *t.shape[1:])
            tensors.append(PhysicalTensor(f"{t.name}.{i}", shape, "bfloat16", (
                Piece(t.name, (lo, *[0] * (len(shape) - 1)), shape, (0,) * len(shape)),)))
    src = Layout("source", "hand", tuple(RankLayout(r, r, tuple(tensors)) for r in range(3)),
                 3)
    cfg = Config(model=ModelConfig("hand"), source=SourceConfig("fsdp2", dp_replicate=3),
                 target=TargetConfig("vllm", replicas=3),
                 cluster=ClusterConfig(gpus_per_host=2, nics_per_host=1),
                 options=Options(max_write_bytes=4096))
    plan = compile_layouts(cfg, spec, src, whole_tensors(spec, "target", "bfloat16", 3))
    assert plan.header.stats.gather_unit_max == 3 * 512  # every box was gathered
    assert verify.balance(plan) == []
    assert verify_plan(plan) == []
