"""Block-FP8 on the GPU: the same plans as test_fp8.py, run with every rank's tensors on
CUDA (`run_all_local`: packs, gathers and QUANT as CUDA kernels), must produce the bytes
of the CPU reference quantizer exactly. Run on the device: `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from harness.weights import materialize, quantize_full, random_full_tensors
from planner.compiler import compile_layouts
from planner.fp8 import quantize_layout, with_scales
from planner.spec import spec_from_hf
from schemas.plan_write import write_plan
from tests.support.synthetic import FP8_HF as HF
from tests.support.synthetic import fp8_config as _config
from tests.support.synthetic import fused_col_split, row_split

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind", ["rows", "cols", "aligned"])
def test_fp8_quant_on_gpu_matches_cpu_reference(tmp_path, kind):
    import executor

    spec = spec_from_hf(HF)
    src = {"rows": lambda: row_split(spec, 3), "cols": lambda: fused_col_split(spec, 4),
           "aligned": lambda: fused_col_split(spec, 2)}[kind]()
    dst = quantize_layout(fused_col_split(spec, 2, 2), spec)
    path = str(tmp_path / "p.rplan")
    write_plan(path, compile_layouts(_config(), with_scales(spec), src, dst))
    full = random_full_tensors(spec, seed=5)
    want = materialize(dst, quantize_full(spec, full))  # CPU reference
    tensors = {r: {k: v.cuda() for k, v in t.items()} for r, t in materialize(src, full).items()}
    n = len(src.ranks)
    for r, t in want.items():
        tensors[n + r] = {k: torch.zeros_like(v, device="cuda") for k, v in t.items()}
    executor.run_all_local(path, tensors)
    for r, t in want.items():
        for name, w in t.items():
            got = tensors[n + r][name].cpu()
            assert torch.equal(got.view(torch.uint8), w.view(torch.uint8)), (r, name)
