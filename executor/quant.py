"""QUANT ops: block-FP8 quantization of a 2-d box into staging, prepared once.

The formula is vLLM's `per_block_cast_to_fp8` (and the planner's reference quantizer,
which tests hold this to bit for bit): per 128x128 block, `scale = max(amax, 1e-4) /
448`, `q = (x.float() * (1 / scale))` cast to e4m3; a partial edge block takes the amax of
its real elements. e4m3 values land at `dst_offset` (bytes) in rows `dst_stride0` apart and
the float32 scales `[ceil(m/128), ceil(n/128)]` at `aux_offset` (float32 elements) of the
same region, in rows `scale_stride(dst_stride0)` apart (`schemas.protocol`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from schemas.plan import DTYPE_CODES, Table
from schemas.protocol import FP8_BLOCK as BLOCK
from schemas.protocol import FP8_MAX, scale_stride

from .bind import torch_dtype, typed

Op = Callable[[], None]


def quantize_into(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor,
                  pad: torch.Tensor) -> None:
    """Quantize the 2-d `x` into `q_out` (e4m3, x's shape) and `s_out` (float32 scales);
    `pad` is a zeroed scratch tensor of x's dtype padded to multiples of 128."""
    m, n = x.shape
    pad[:m, :n].copy_(x)
    pm, pn = pad.shape
    blocks = pad.view(pm // BLOCK, BLOCK, pn // BLOCK, BLOCK)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    # amax / 448 as a tensor division: correctly rounded on GPUs too (a division by a Python
    # scalar becomes a multiplication by its reciprocal on CUDA, off by one ulp).
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn)
    q_out.copy_(q.view(pm, pn)[:m, :n])
    s_out.copy_(scale.view(pm // BLOCK, pn // BLOCK))


def prepare_quants(copies: Table, rows: np.ndarray, regions: list[torch.Tensor]) -> list[Op]:
    """On a GPU, one kernel for the rows it takes (`quant_kernel.py`); one op per other
    QUANT row, with its views and scratch built now, not per step."""
    from .gpu.quant_kernel import prepare

    kernel, rows = prepare(copies, rows, regions)
    ops = [kernel] if kernel is not None else []
    for i in rows.tolist():
        m, n = int(copies["size0"][i]), int(copies["size1"][i])
        src = typed(regions[int(copies["src_region"][i])],
                    torch_dtype(DTYPE_CODES[int(copies["src_dtype"][i])]))
        x = src.as_strided((m, n), (int(copies["src_stride0"][i]),
                                    int(copies["src_stride1"][i])),
                           src.storage_offset() + int(copies["src_offset"][i]))
        dst = regions[int(copies["dst_region"][i])]
        qf = typed(dst, torch.float8_e4m3fn)  # offsets count from the region, not its storage
        row = int(copies["dst_stride0"][i])
        q = qf.as_strided((m, n), (row, 1), qf.storage_offset() + int(copies["dst_offset"][i]))
        sf = typed(dst, torch.float32)
        rb, cb = -(-m // BLOCK), -(-n // BLOCK)
        s = sf.as_strided((rb, cb), (int(scale_stride(row)), 1),
                          sf.storage_offset() + int(copies["aux_offset"][i]))
        pad = torch.zeros((rb * BLOCK, cb * BLOCK), dtype=x.dtype, device=x.device)

        def op(x=x, q=q, s=s, pad=pad) -> None:
            quantize_into(x, q, s, pad)
        ops.append(op)
    return ops
