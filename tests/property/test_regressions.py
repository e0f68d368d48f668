"""Failing examples the property suite found, as explicit tests with the geometry spelled
out. Bugs in files the suite's owner does not own stay `xfail(strict=True)` until fixed
(then the marker must go: strict makes the fixed test fail as XPASS)."""

from __future__ import annotations

import pytest

from planner.compiler import compile_layouts
from planner.layouts.base import Layout, PhysicalTensor, Piece, RankLayout
from planner.spec import ModelSpec, spec_from_hf
from planner.verify import verify_plan
from schemas.config import ClusterConfig, Config, ModelConfig, Options, SourceConfig, TargetConfig
from schemas.plan import STAGING

# A one-layer llama with 8x8 weights (128 bytes each in bf16) and 8-element norms (16 bytes).
TINY = dict(model_type="llama", hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
            head_dim=8, intermediate_size=8, vocab_size=8, num_hidden_layers=1,
            tie_word_embeddings=True)


def whole_tensors(spec: ModelSpec, side: str, dtype: str, world: int = 1) -> Layout:
    """Every rank holds every logical tensor whole, under its checkpoint name."""
    tensors = tuple(PhysicalTensor(t.name, t.shape, dtype, (
        Piece(t.name, (0,) * len(t.shape), t.shape, (0,) * len(t.shape)),))
        for t in spec.tensors)
    return Layout(side, "hand", tuple(RankLayout(r, r, tensors) for r in range(world)),
                  world)  # type: ignore[arg-type]


def config(**opts: int) -> Config:
    return Config(model=ModelConfig("hand"), source=SourceConfig("fsdp2", dtype="float32"),
                  target=TargetConfig("vllm"),
                  cluster=ClusterConfig(gpus_per_host=1, nics_per_host=1),
                  options=Options(**opts))


def test_staging_budget_not_a_multiple_of_64() -> None:
    # 1 fp32 source rank -> 1 bf16 target rank, whole tensors: every tensor is cast, so
    # every chunk is packed into the source's staging. staging_bytes=150: stage 0 takes
    # embed_tokens (128 bytes at 0; the next offset is aligned to 128) and then
    # input_layernorm (16 bytes, fits: 128 + 16 <= 150) at 128; the staging region is
    # then sized to the aligned end 128 + 64 = 192 > 150.
    spec = spec_from_hf(TINY)
    plan = compile_layouts(config(max_write_bytes=4096, staging_bytes=150), spec,
                           whole_tensors(spec, "source", "float32"),
                           whole_tensors(spec, "target", "bfloat16"))
    staging = [r.nbytes for rp in plan.ranks for r in rp.regions if r.name == STAGING]
    assert max(staging) <= 150
    assert verify_plan(plan) == []


# ---------------------------------------------------------------- mutated plans (property 9)
#
# Geometry of all three: the TINY llama, 1 bf16 source rank (plan rank 0) -> 1 bf16 target
# rank (plan rank 1), whole tensors, one host with 2 GPUs (colocated): one stage; rank 1
# sends READY to rank 0 (stage 0), rank 0 sends DONE to rank 1 (stage 0). One value of the
# decoded plan is changed and the plan re-encoded with valid checksums.

def _mutated_plan(tmp_path, change) -> tuple[str, str]:
    import dataclasses

    from schemas.plan import encode_plan
    from tests.property.case_io import case_json
    from tests.property.strategies import Case

    spec = spec_from_hf(TINY)
    src, dst = whole_tensors(spec, "source", "bfloat16"), whole_tensors(spec, "target",
                                                                         "bfloat16")
    cfg = dataclasses.replace(config(), source=SourceConfig("fsdp2"),
                              cluster=ClusterConfig(gpus_per_host=2, nics_per_host=1,
                                                    placement="colocated"))
    plan = compile_layouts(cfg, spec, src, dst)
    assert plan.header["stages"] == 1 and len(plan.ranks) == 2
    ranks = list(plan.ranks)
    ranks = change(ranks)
    path, case_path = str(tmp_path / "p.rplan"), str(tmp_path / "case.json")
    with open(path, "wb") as f:
        f.write(encode_plan(dataclasses.replace(plan, ranks=tuple(ranks))))
    with open(case_path, "w", encoding="utf-8") as f:
        f.write(case_json(Case(spec, src, dst, cfg, TINY)))
    return path, case_path


def _sandboxed(path: str, case_path: str) -> dict:
    from tests.property.sandbox import Sandbox

    box = Sandbox(timeout_s=8.0)
    try:
        return box.run(path, case_path)
    finally:
        box.stop()


def test_rank_stage_count_differs_from_header(tmp_path) -> None:
    import dataclasses

    import torch

    import executor
    from schemas.plan import load_plan
    from tests.property.harness import SENTINEL

    path, _ = _mutated_plan(tmp_path, lambda r: [r[0], dataclasses.replace(r[1], stages=2)])
    spec = spec_from_hf(TINY)
    tensors = {rank: {t.name: torch.full(t.shape, SENTINEL, dtype=torch.bfloat16)
                      for t in spec.tensors} for rank in (0, 1)}
    assert len(load_plan(path).ranks) == 2
    with pytest.raises(executor.PlanBoundsError):
        executor.run_all_local(path, tensors)


def test_huge_stage_count_is_rejected(tmp_path) -> None:
    import dataclasses

    path, case_path = _mutated_plan(
        tmp_path, lambda r: [dataclasses.replace(r[0], stages=2**40), r[1]])
    answer = _sandboxed(path, case_path)
    assert answer["outcome"] == "error" and "PlanBoundsError" in answer["types"], answer
    assert answer["guards_ok"]


def test_signal_to_a_rank_outside_the_world_is_rejected(tmp_path) -> None:
    import dataclasses

    from tests.property.mutate import _table

    def change(r):
        sig = r[1].signals
        return [r[0], dataclasses.replace(r[1], signals=_table(sig, 0, "peer", 5))]
    path, case_path = _mutated_plan(tmp_path, change)
    answer = _sandboxed(path, case_path)
    assert answer["outcome"] == "error" and "PlanBoundsError" in answer["types"], answer



def test_rank_blob_missing_from_the_file_is_rejected(tmp_path) -> None:
    # Found by the fast profile (p9: "rank 4: rank = 5"). Rank 0's plan is re-encoded
    # claiming to be rank 1: the file then holds two blobs named rank/1 (the index keeps
    # the second, rank 1's own) and none for rank 0, while the header still says world=2.
    # Run in one process, rank 1 waited for rank 0's regions until its 60 s timeout (the
    # sandbox saw a hang); the file must be refused while loading instead.
    import dataclasses

    path, case_path = _mutated_plan(
        tmp_path, lambda r: [dataclasses.replace(r[0], rank=1), r[1]])
    answer = _sandboxed(path, case_path)
    assert answer["outcome"] == "error" and "PlanFormatError" in answer["types"], answer
    assert answer["guards_ok"]

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
    # chunks and held by h=2 ranks, c*h - c - h = 1 write saved, so `_fine_cut` chooses to
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
    # land as rows") while `_fine_cut` had rightly let it through.
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
    assert plan.header["stats"]["gather_unit_max"] > 0  # the columns were gathered
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
    assert plan.header["stats"]["gather_unit_max"] > 0  # the weights were gathered
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
    from planner import verify

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
    assert plan.header["stats"]["gather_unit_max"] == 3 * 512  # every box was gathered
    assert verify.balance(plan) == []
    assert verify_plan(plan) == []


# ------------------------------------------------ validate accepts, the layout refuses
# `planner.validate.validate` passes these configs, then `build_layout` raises a
# ConfigError: the error still names the key, but `validate` (what `rdma-plan` checks
# before compiling) should carry the same rule.

_QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=16, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, intermediate_size=16, vocab_size=64,
                  num_hidden_layers=1, tie_word_embeddings=False, num_experts=2,
                  moe_intermediate_size=8, num_experts_per_tok=1)


@pytest.mark.parametrize("side,kv_heads", [
    # FSDP2+TP: tp=2 over 1 kv head (validate allows GQA replication; FSDP2 cannot).
    (SourceConfig("fsdp2", tp=2), 1),
    # FSDP2 fused experts (`experts.gate_up_proj`) column-cut by tp=2 (2 kv heads).
    (SourceConfig("fsdp2", tp=2, fused_experts=True), 2),
    # vLLM EP over tp*dp = 4 ranks with 2 experts: some ranks get none.
    (TargetConfig("vllm", tp=2, dp=2, ep=True), 1),
], ids=["fsdp2-tp-over-kv-heads", "fsdp2-fused-experts-tp", "vllm-ep-more-ranks-than-experts"])
@pytest.mark.xfail(strict=True, reason="planner.validate accepts a config that the layout "
                   "then refuses with a ConfigError")
def test_validate_agrees_with_the_layouts(side: SourceConfig | TargetConfig,
                                         kv_heads: int) -> None:
    from planner.layouts import build_layout
    from planner.validate import validate

    spec = spec_from_hf({**_QWEN3_MOE, "num_key_value_heads": kv_heads})
    src = side if isinstance(side, SourceConfig) else SourceConfig("fsdp2")
    dst = side if isinstance(side, TargetConfig) else TargetConfig("vllm")
    cfg = Config(model=ModelConfig("hand"), source=src, target=dst)
    try:
        validate(cfg, spec)
    except ValueError:
        return  # validate has the rule: fixed
    build_layout(spec, cfg.source)
    build_layout(spec, cfg.target)


# ------------------------------------------------ property 7 across processes
# The first 34-minute deep run reported a hand-built qwen3_moe case (not shrunk) whose plan
# differed when compiled in another process (PYTHONHASHSEED=12345); 80 more examples, and
# 4,500 cases compared here across processes and 4 hash seeds, never reproduced it. The
# other process imports the checkout as it is *then*, pytest imported it at start-up: the
# same report (an unshrunk random case, shrinking stopped after 5 minutes) comes at once
# when the compiler changes on disk during the run, which most likely happened in that
# run (in a shared checkout; its own p6 fix changed gather.py and the header's stats, and
# p7 runs after p6). The check must say so instead of reporting nondeterminism, and still
# compare the bytes when the code is the same.

def _tree_copy(dst) -> str:
    """The packages the other process imports, copied from this checkout to `dst`."""
    import os
    import shutil

    from tests.property.case_io import ROOT

    skip = shutil.ignore_patterns("__pycache__")
    for pkg in ("planner", "schemas", os.path.join("tests", "property")):
        shutil.copytree(os.path.join(ROOT, pkg), os.path.join(dst, pkg), ignore=skip)
    shutil.copy(os.path.join(ROOT, "tests", "__init__.py"), os.path.join(dst, "tests"))
    return str(dst)


def test_other_process_with_changed_code_is_not_nondeterminism(tmp_path) -> None:
    # A hand-built qwen3_moe (2 experts, 1 layer): 2 fp32 source ranks holding everything
    # -> 2 bf16 target ranks holding everything. Two copies of the tree: this checkout as
    # it is now, and the same with one edit to the compiler (the version string it writes
    # into the header), as an edit made while a run goes on would be. The reference is the
    # first copy (not this process's imports: the checkout may change under this test too).
    import os

    from tests.property.case_io import CheckoutChanged, compile_elsewhere, source_digests
    from tests.property.strategies import Case

    spec = spec_from_hf(_QWEN3_MOE)
    case = Case(spec, whole_tensors(spec, "source", "float32", 2),
                whole_tensors(spec, "target", "bfloat16", 2), config(), _QWEN3_MOE)
    same = _tree_copy(tmp_path / "same")
    code = source_digests(same)
    data = compile_elsewhere(case, hash_seed="0", root=same, reference=code)
    assert compile_elsewhere(case, hash_seed="12345", root=same, reference=code) == data
    edited = _tree_copy(tmp_path / "edited")
    with open(os.path.join(edited, "planner", "compiler.py"), "a", encoding="utf-8") as f:
        f.write('\nVERSION = "rdma-plan (edited during the run)"\n')
    with pytest.raises(CheckoutChanged) as e:
        compile_elsewhere(case, hash_seed="12345", root=edited, reference=code)
    assert e.value.files == [os.path.join("planner", "compiler.py")]
