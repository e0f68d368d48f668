"""The FP8 quantizer kernels (`executor/gpu/quant_kernel.py`) against the CPU reference
quantizer, bit for bit: partial edge blocks, strided and float32 sources, blocks under the
1e-4 amax floor, e4m3 subnormals, several boxes in one launch, rows read 16 bytes at a time
(CUDA blocks reading ahead across many blocks and boxes) and element by element; the two
kernels against each other where the reference differs by design (NaN and infinity); and
the e4m3 conversion against torch's for every float32. Run on the device: `pytest -m gpu`."""

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


def _table(xs: list[torch.Tensor]) -> tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The op table of boxes `xs` into destinations whose rows are wider than the box (set
    to 0x55 and -1.0, to see any write past it), and those destinations."""
    from executor.gpu.quant_kernel import BLOCK, COLS, SRC_KINDS, firsts, vector_kind

    outs, table = [], []
    for x in xs:
        m, n = x.shape
        qrow = n + 32
        srow = -(-qrow // BLOCK)
        q = torch.full((m, qrow), 0x55, dtype=torch.uint8, device="cuda")
        s = torch.full((-(-m // BLOCK), srow), -1.0, device="cuda")
        kind = SRC_KINDS["float32" if x.dtype == torch.float32 else "bfloat16"]
        table.append([x.data_ptr(), x.stride(0), x.stride(1), m, n, q.data_ptr(), qrow,
                      s.data_ptr(), srow, kind, 0])
        outs.append((q, s))
    assert len(table[0]) == COLS
    table = np.array(table, dtype=np.int64)
    table[:, 9] = vector_kind(table)
    return firsts(table), outs


def _check(xs, outs) -> None:
    for i, (x, (q, s)) in enumerate(zip(xs, outs)):
        m, n = x.shape
        q_ref, s_ref = quantize_block128(x.cpu())
        got_q, got_s = q.cpu(), s.cpu()
        assert torch.equal(got_q[:, :n], q_ref.view(torch.uint8)), f"box {i}: e4m3 values"
        assert (got_q[:, n:] == 0x55).all(), f"box {i}: wrote past the box"
        cb = -(-n // 128)
        assert torch.equal(got_s[:, :cb].view(torch.int32), s_ref.view(torch.int32)), \
            f"box {i}: scales"
        assert (got_s[:, cb:] == -1.0).all(), f"box {i}: wrote past the scales"


def test_kernels_match_the_cpu_reference() -> None:
    from executor.gpu.quant_kernel import RowsQuantKernel, quant_op

    assert RowsQuantKernel.load(torch.device("cuda")) is not None, "NVRTC: no rows kernel"
    xs = [x.cuda() for x in _boxes()]
    xs.append(xs[0][3:131, 10:138])  # a window of rows 520 apart, not 16-byte aligned
    table, outs = _table(xs)
    assert sorted(table[:, 9].tolist()) == [0, 0, 1, 2], table[:, 9]  # every path
    op = quant_op(table, torch.device("cuda"))
    assert op is not None, "NVRTC could not build the kernels"
    op()
    torch.cuda.synchronize()
    _check(xs, outs)


def _rows_boxes(seed: int) -> list[torch.Tensor]:
    """bfloat16 boxes of aligned rows, more 128x128 blocks than the rows kernel has CUDA
    blocks (each reads ahead across blocks and boxes), with partial edge blocks."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 8), (1100, 1032), (2000, 4096), (128, 4096), (129, 136), (4096, 1024)]
    xs = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    xs[1][:128, :128] *= 1e-7
    xs[2][256:384, 512:640] = 0.0
    xs[2][700, 900] = 3e4
    return [x.cuda() for x in xs]


def test_rows_kernel_reads_ahead_across_blocks_and_boxes() -> None:
    from executor.gpu.quant_kernel import ROWS, quant_op

    xs = _rows_boxes(11)
    table, outs = _table(xs)
    assert (table[:, 9] == ROWS).all()
    quant_op(table, torch.device("cuda"))()
    torch.cuda.synchronize()
    _check(xs, outs)


def test_rows_kernel_equals_the_element_kernel_on_nan_and_infinity() -> None:
    """Where the reference differs by design (its amax keeps a NaN, the kernels' drops it,
    as the kernel always has), the two kernels give the same bytes."""
    from executor.gpu.quant_kernel import SRC_KINDS, QuantKernel, quant_op

    xs = _rows_boxes(12)
    x = xs[2]
    x[0, :8] = torch.tensor([float("nan"), -float("nan"), 1.0, -2.0, 0.0, -0.0, 1e-30, 7.0])
    x[130, 5] = float("inf")  # its block: scale inf, values inf * 0 = NaN, 0 and -0
    x[300, 300] = -float("inf")
    x[600, 1000:1008] = float("nan")
    table, outs = _table(xs)
    quant_op(table, torch.device("cuda"))()
    slow_table, slow = _table(xs)
    slow_table[:, 9] = SRC_KINDS["bfloat16"]
    QuantKernel.load(torch.device("cuda")).op(slow_table)()
    torch.cuda.synchronize()
    for i, ((q, s), (q2, s2)) in enumerate(zip(outs, slow)):
        assert torch.equal(q, q2), f"box {i}: e4m3 values"
        assert torch.equal(s.view(torch.int32), s2.view(torch.int32)), f"box {i}: scales"


CONVERT = r"""
extern "C" __global__ void rplan_e4m3_all(int first, int n4, unsigned int* out,
                                          unsigned int* port) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4;
       i += (long long)gridDim.x * blockDim.x) {
    const unsigned int b = (unsigned int)first + 4u * (unsigned int)i;
    float f[4];
    for (int j = 0; j < 4; ++j) f[j] = __uint_as_float(b + (unsigned int)j);
    out[i] = e4m3x4(f[0], f[1], f[2], f[3]);
    port[i] = (unsigned int)fp8e4m3fn(f[0]) | ((unsigned int)fp8e4m3fn(f[1]) << 8)
              | ((unsigned int)fp8e4m3fn(f[2]) << 16) | ((unsigned int)fp8e4m3fn(f[3]) << 24);
  }
}
"""


def test_e4m3_conversion_is_torchs_for_every_float32() -> None:
    """The rows kernel's conversion (the hardware's, the port for a NaN) gives the port's
    e4m3 for all 2^32 float32 bit patterns, and the port gives torch's on the CPU for every
    97th under 464 in magnitude or NaN. From 464 up torch gives NaN and both kernels 448,
    as the element kernel always has: the quantizer converts `x * (1 / (amax / 448))`,
    never more than 448 by more than a few ulps."""
    from executor.gpu.quant_kernel import E4M3

    fn = torch.cuda._compile_kernel(E4M3 + CONVERT, "rplan_e4m3_all")
    chunk = 1 << 28
    out = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    port = torch.empty_like(out)
    for first in range(0, 1 << 32, chunk):
        signed = first - (1 << 32) if first >= 1 << 31 else first
        fn(grid=(4096, 1, 1), block=(256, 1, 1), args=[signed, chunk // 4, out, port])
        bad = (out != port).nonzero()
        assert not len(bad), (f"{len(bad)} differ from the port, first at float bits "
                              f"{hex(first + int(bad[0]))}: {int(out[bad[0]])} != "
                              f"{int(port[bad[0]])}")
        x = (torch.arange(0, chunk, 97, dtype=torch.int32) + signed).view(torch.float32)
        cpu = x.to(torch.float8_e4m3fn).view(torch.uint8)
        inside = ~(x.abs() >= 464.0)  # NaN inside
        assert torch.equal(port[::97].cpu()[inside], cpu[inside]), \
            f"the port differs from torch from {first}"
