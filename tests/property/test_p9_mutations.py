"""Property 9: a mutated plan either fails to load with a clear error or runs entirely
within bounds: never a hang, a crash, another exception type, or a write outside its
tensors.

A small random case is compiled, its plan file mutated (`mutate.py`: raw bytes, or one
value of a decoded plan re-encoded with valid checksums), and the result run with
`executor.run_all_local` in a child process (`sandbox.py`: every tensor inside guard
bytes, address space capped, 30 s timeout). Accepted outcomes: a clean run with every
guard byte intact, or one of the errors the formats and the executor document for bad
plans (`CLEAR`) raised from our own code, guards intact.
"""

from __future__ import annotations

import atexit
import os
import tempfile

from hypothesis import given, note
from hypothesis import strategies as st

from schemas.plan import load_plan
from schemas.plan_write import encode_plan, write_plan
from tests.property import harness
from tests.property.case_io import case_json
from tests.property.mutate import raw_mutation, semantic_mutation
from tests.property.sandbox import Sandbox
from tests.property.strategies import Case, cases

CLEAR = {"PlanFormatError", "PlanBoundsError", "BindError", "PeerMismatchError",
         "PlanDeadlockError", "PeerTimeoutError"}
"""Errors that name what is wrong with a plan (schemas.plan, executor.errors/world)."""

SANDBOX = Sandbox(timeout_s=30.0)
atexit.register(SANDBOX.stop)


def acceptable(answer: dict) -> str | None:
    """None if the outcome is allowed, else why not."""
    if answer["outcome"] in ("crash", "hang"):
        return f"{answer['outcome']}: {answer.get('detail')}"
    if not answer["guards_ok"]:
        return f"wrote outside its tensors (outcome {answer['outcome']})"
    if answer["outcome"] == "ok":
        return None
    types, where = set(answer["types"]), answer["raised_in"]
    ours = where.startswith(("executor/", "schemas/"))
    if types & CLEAR or ("ValueError" in types and ours):
        return None
    return f"{answer['types'][0]} from {where}: {answer['message']}"


@given(cases(), st.data())
def test_mutated_plans_fail_cleanly_or_stay_in_bounds(case: Case, data: st.DataObject) -> None:
    plan = harness.compile_case(case)
    raw = encode_plan(plan)
    with tempfile.TemporaryDirectory() as tmp:
        path, case_path = os.path.join(tmp, "p.rplan"), os.path.join(tmp, "case.json")
        write_plan(path, plan)
        base = load_plan(path)
        what, mutate = data.draw(st.one_of(raw_mutation(len(raw)), semantic_mutation(base)))
        note(f"mutation: {what}")
        with open(path, "wb") as f:
            f.write(mutate(raw, base))
        with open(case_path, "w", encoding="utf-8") as f:
            f.write(case_json(case))
        answer = SANDBOX.run(path, case_path)
    note(f"answer: {answer}")
    assert acceptable(answer) is None, acceptable(answer)
