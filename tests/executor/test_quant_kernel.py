"""The FP8 quantizer kernel (`executor/quant_kernel.py`) against the CPU reference
quantizer, bit for bit: partial edge blocks, strided and float32 sources, blocks under the
1e-4 amax floor, e4m3 subnormals, several boxes in one launch, rows read 16 bytes at a time
and element by element. Run on the device:
`pytest -m gpu`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.weights import quantize_block128

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _boxes() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    full = torch.randn(300, 520, generator=g)
    full[:128, :128] *= 1e-7  # amax under 1e-4: the floor's scale, subnormal e4m3
    full[128:256, 128:256] *= 1e-3
    full[256:, 256:384] = 0.0
    full[5, 7] = 1e4  # one large value: its block's others go subnormal
    return [full.bfloat16(),  # partial blocks both ways
            full.bfloat16()[:, 64:].t().contiguous().t(),  # column-major: stride1 != 1
            full[:256, :384].clone()]  # float32 source, whole blocks


def test_kernel_matches_the_cpu_reference() -> None:
    from executor.gpu.quant_kernel import BLOCK, COLS, SRC_KINDS, QuantKernel, vector_kind

    kernel = QuantKernel.load(torch.device("cuda"))
    assert kernel is not None, "NVRTC could not build the kernel"
    xs = [x.cuda() for x in _boxes()]
    xs.append(xs[0][3:131, 10:138])  # a window of rows 520 apart, not 16-byte aligned
    outs, table, first = [], [], 0
    for x in xs:
        m, n = x.shape
        qrow = n + 32  # the destination's rows are wider than the box
        srow = -(-qrow // BLOCK)
        q = torch.full((m, qrow), 0x55, dtype=torch.uint8, device="cuda")
        s = torch.full((-(-m // BLOCK), srow), -1.0, device="cuda")
        kind = SRC_KINDS["float32" if x.dtype == torch.float32 else "bfloat16"]
        table.append([x.data_ptr(), x.stride(0), x.stride(1), m, n, q.data_ptr(), qrow,
                      s.data_ptr(), srow, kind, first])
        first += -(-m // BLOCK) * -(-n // BLOCK)
        outs.append((q, s))
    assert len(table[0]) == COLS
    table = np.array(table, dtype=np.int64)
    table[:, 9] = vector_kind(table)
    assert sorted(table[:, 9].tolist()) == [0, 0, 1, 2], table[:, 9]  # every path of the kernel
    kernel.op(table)()
    torch.cuda.synchronize()
    for i, (x, (q, s)) in enumerate(zip(xs, outs)):
        m, n = x.shape
        q_ref, s_ref = quantize_block128(x.cpu())
        got_q, got_s = q.cpu(), s.cpu()
        assert torch.equal(got_q[:, :n], q_ref.view(torch.uint8)), f"box {i}: e4m3 values"
        assert (got_q[:, n:] == 0x55).all(), f"box {i}: wrote past the box"
        cb = -(-n // BLOCK)
        assert torch.equal(got_s[:, :cb].view(torch.int32), s_ref.view(torch.int32)), \
            f"box {i}: scales"
        assert (got_s[:, cb:] == -1.0).all(), f"box {i}: wrote past the scales"
