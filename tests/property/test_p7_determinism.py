"""Property 7: compiling twice is byte-identical; encode -> decode -> encode is identical.

Twice in this process, and once more in a fresh interpreter with another
`PYTHONHASHSEED` (set and dict orders of strings differ there), from the case written
as JSON (`case_io`): the plan file must not depend on either.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from hypothesis import given, settings

from planner.compiler import compile_layouts
from schemas.plan import encode_plan, load_plan, write_plan
from tests.property import harness
from tests.property.case_io import case_from_json, case_json
from tests.property.strategies import Case, cases

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@given(cases())
def test_compile_is_deterministic_and_round_trips(case: Case) -> None:
    plan = harness.compile_case(case)
    data = encode_plan(plan)
    again = compile_layouts(case.cfg, case.spec, case.src, case.dst)
    assert encode_plan(again) == data
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.rplan")
        write_plan(path, plan)
        with open(path, "rb") as f:
            assert f.read() == data
        assert encode_plan(load_plan(path)) == data
    rebuilt = case_from_json(case_json(case))
    assert encode_plan(compile_layouts(rebuilt.cfg, rebuilt.spec, rebuilt.src,
                                       rebuilt.dst)) == data


@settings(max_examples=max(2, settings.default.max_examples // 6))
@given(cases())
def test_compile_is_identical_in_another_process(case: Case) -> None:
    data = encode_plan(harness.compile_case(case))
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = os.path.join(tmp, "case.json"), os.path.join(tmp, "p.rplan")
        with open(spec_path, "w", encoding="utf-8") as f:
            f.write(case_json(case))
        env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": ROOT}
        subprocess.run([sys.executable, "-m", "tests.property.case_io", spec_path, out],
                       check=True, env=env, cwd=ROOT, timeout=120)
        with open(out, "rb") as f:
            assert f.read() == data
