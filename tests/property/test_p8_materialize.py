"""Property 8: `run_all_local` on `materialize`d sources equals `materialize`d targets,
bit for bit: bf16 -> bf16, fp32 -> bf16 (the cast rounds to nearest even, as torch's
`copy_` does in `materialize`), and any other mix of bf16/fp16/fp32.

The logical tensors are random float32 values with low bits set (`bf16` cannot hold them:
a missed or doubled rounding shows). A source holds them rounded to its dtype; the
expected target is `materialize` of those source values (so a bf16 source feeding an fp32
target expects the bf16 values), with padding left at `SENTINEL`. Block-FP8 targets
expect `harness.weights.quantize_full` of the source values (e4m3 weights and their scales).
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.weights import DTYPES, quantize_full
from tests.property import harness
from tests.property.strategies import Case, cases


def source_dtypes(case: Case) -> dict[str, str]:
    return {p.tensor: pt.dtype for rl in case.src.ranks for pt in rl.tensors
            for p in pt.pieces}


@given(st.one_of(cases("bfloat16", "bfloat16"), cases("float32", "bfloat16"), cases()),
       st.integers(0, 2**31 - 1))
def test_run_reproduces_materialized_targets(case: Case, seed: int) -> None:
    plan = harness.compile_case(case)
    g = torch.Generator().manual_seed(seed)
    full = {t.name: torch.randn(t.shape, generator=g) * (1 + 1e-3 * torch.rand(t.shape,
                                                                              generator=g))
            for t in case.spec.tensors}
    got = harness.run(plan, case, full)
    held = {name: full[name].to(DTYPES[dt]).float() for name, dt in source_dtypes(case).items()}
    if case.cfg.target.dtype == "fp8_block128":
        held = quantize_full(case.spec, held)
    assert harness.mismatches(got, harness.expected(case, held)) == []
