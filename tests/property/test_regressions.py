"""Failing examples the property suite found, as explicit tests with the geometry spelled
out. Bugs in files the suite's owner does not own stay `xfail(strict=True)` until fixed
(then the marker must go: strict makes the fixed test fail as XPASS)."""

from __future__ import annotations

import pytest

from planner.compiler import compile_layouts
from planner.spec import spec_from_hf
from schemas.config import ClusterConfig, SourceConfig
from tests.support.synthetic import TINY, whole_tensors
from tests.support.synthetic import tiny_config as config

# ---------------------------------------------------------------- mutated plans (property 9)
#
# Geometry of all three: the TINY llama, 1 bf16 source rank (plan rank 0) -> 1 bf16 target
# rank (plan rank 1), whole tensors, one host with 2 GPUs (colocated): one stage; rank 1
# sends READY to rank 0 (stage 0), rank 0 sends DONE to rank 1 (stage 0). One value of the
# decoded plan is changed and the plan re-encoded with valid checksums.

def _mutated_plan(tmp_path, change) -> tuple[str, str]:
    import dataclasses

    from schemas.plan_write import encode_plan
    from tests.property.case_io import case_json
    from tests.property.strategies import Case

    spec = spec_from_hf(TINY)
    src, dst = whole_tensors(spec, "source", "bfloat16"), whole_tensors(spec, "target",
                                                                         "bfloat16")
    cfg = dataclasses.replace(config(), source=SourceConfig("fsdp2"),
                              cluster=ClusterConfig(gpus_per_host=2, nics_per_host=1,
                                                    placement="colocated"))
    plan = compile_layouts(cfg, spec, src, dst)
    assert plan.header.stages == 1 and len(plan.ranks) == 2
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

    box = Sandbox(timeout_s=30.0)  # a load of 8 on 2 cores starts a process in ~8 s
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


_QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=16, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, intermediate_size=16, vocab_size=64,
                  num_hidden_layers=1, tie_word_embeddings=False, num_experts=2,
                  moe_intermediate_size=8, num_experts_per_tok=1)


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
