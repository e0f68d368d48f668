"""`verify`, `inspect` and `simulate` report progress through the whole read of a plan:
the ranks, then (`verify`, `inspect`) the check of the explain blob (a third of a large
plan's bytes, seconds at DeepSeek-V3 scale), and `simulate` its batches landed; `explain`
its steps."""

from __future__ import annotations

from pathlib import Path

from planner.tools.inspect import inspect_text
from planner.tools.simulate import simulate
from planner.tools.verify import verify_file
from schemas.plan_write import write_plan
from tests.support.synthetic import fsdp2_to_vllm_plan

BLOBS = "checking the explain blob"


def _steps(tool, path: str) -> list[str]:
    lines: list[str] = []
    tool(path, lines.append)
    return lines


def test_each_tool_reports_ranks_then_the_blob_check(tmp_path: Path) -> None:
    plan = fsdp2_to_vllm_plan({"staging_bytes": 8192, "max_write_bytes": 4096},
                              "disaggregated")
    path = str(tmp_path / "p.rplan")
    write_plan(path, plan)
    world = len(plan.ranks)
    runs = {"verify": _steps(verify_file, path),
            "inspect": _steps(lambda p, cb: inspect_text(p, False, cb), path),
            "simulate": _steps(lambda p, cb: simulate(p, progress=cb), path)}
    for name, lines in runs.items():
        last_rank = max(i for i, x in enumerate(lines) if x.endswith(f"{world}/{world}"))
        blobs = [i for i, x in enumerate(lines) if x.startswith(BLOBS)]
        if name == "simulate":  # it reads no blob but the ranks (nor checks one)
            assert not blobs and lines.index("simulating") > last_rank, lines
        else:
            assert blobs and blobs[0] > last_rank, (name, lines)
    assert any("batches landed" in x for x in runs["simulate"])


def test_explain_reports_its_steps(tmp_path: Path) -> None:
    from planner.tools.inspect import explain_text

    plan = fsdp2_to_vllm_plan({}, "disaggregated")
    path = str(tmp_path / "p.rplan")
    write_plan(path, plan)
    lines: list[str] = []
    text = explain_text(path, plan.tensors[0], False, lines.append)
    assert plan.tensors[0] in text
    assert lines == ["reading the explain blob", "reading the ranks it names",
                     "reading the source ranks' tensors"]
