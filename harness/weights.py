"""Synthetic weights (need torch): physical tensors built from logical ones, and FP8.

The demo, the benchmarks and the tests use these as the weights they move and as the
expected values: `materialize` builds
the source tensors a trainer would hold and the target tensors an engine must end up with
(padding, elements no piece covers, is zero); `random_full_tensors` draws logical tensors;
`quantize_block128` / `quantize_full` give the FP8 form of logical tensors with the
executor's quantizer (`executor.quant.quantize_into`, vLLM's formula: one home, the code
that runs on the sources). The compiler never imports this package (it is torch-free).
"""

from __future__ import annotations

import torch

from integrations import tensor_sha256
from planner.fp8 import BLOCK, SCALE_SUFFIX, is_quantized
from planner.layouts.base import Layout, Piece
from planner.spec import ModelSpec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn}


def piece_view(physical: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The view of `physical` that holds `piece`, shaped like the logical box."""
    view = physical
    for d, (start, size) in enumerate(zip(piece.at, piece.phys_sizes())):
        view = view.narrow(d, start, size)
    dims = piece.phys_dims()
    extra = [d for d in range(physical.dim()) if d not in dims]
    view = view.permute(*dims, *extra)
    return view.reshape(view.shape[: len(dims)]) if extra else view


def logical_box(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    view = full
    for d, (start, size) in enumerate(zip(piece.offsets, piece.sizes)):
        view = view.narrow(d, start, size)
    return view


def materialize(layout: Layout, full: dict[str, torch.Tensor],
                ranks: list[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """{rank: {native name: tensor}} for `layout`, filled from `full` logical tensors."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for rl in layout.ranks:
        if ranks is not None and rl.rank not in ranks:
            continue
        tensors = {}
        for pt in rl.tensors:
            t = torch.zeros(pt.shape, dtype=DTYPES[pt.dtype])
            for piece in pt.pieces:
                if piece.tensor not in full:
                    raise KeyError(f"materialize: logical tensor {piece.tensor!r} (needed by "
                                   f"rank {rl.rank} {pt.name}) is missing from full tensors")
                piece_view(t, piece).copy_(logical_box(full[piece.tensor], piece))
            tensors[pt.name] = t
        out[rl.rank] = tensors
    return out


def assemble(layout: Layout, parts: dict[int, dict[str, torch.Tensor]],
             full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `materialize`: copy every piece of `parts` ({rank: {native name:
    tensor}}, e.g. a trainer's gathered shards under its source layout) into `full`
    logical tensors (filled in place and returned)."""
    for rl in layout.ranks:
        for pt in rl.tensors:
            for piece in pt.pieces:
                logical_box(full[piece.tensor], piece).copy_(
                    piece_view(parts[rl.rank][pt.name], piece))
    return full


def layout_digests(layout: Layout, full: dict[str, torch.Tensor]) -> dict[int, dict[str, str]]:
    """{rank: {native name: sha256}} of every tensor `layout` builds from `full` logical
    tensors: what an engine laid out that way must hold, byte for byte."""
    return {r: {n: tensor_sha256(t) for n, t in tensors.items()}
            for r, tensors in materialize(layout, full).items()}


def random_full_tensors(spec: ModelSpec, seed: int = 0,
                        scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random logical tensors for a model spec (tests and the demo); exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in spec.tensors:
        x = torch.randn(t.shape, generator=g, dtype=torch.float32) * scale
        out[t.name] = x.to(DTYPES[t.dtype])
    return out


def quantize_block128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 tensor like x, float32 scales [ceil(m/128), ceil(n/128)]) of a 2-d tensor,
    computed by the executor's quantizer: `scale = max(amax(block), 1e-4) / 448`,
    `q = (x.float() * (1 / scale))` cast to e4m3; a partial edge block takes the amax of
    its real elements."""
    from executor.quant import quantize_into

    m, n = x.shape
    rb, cb = -(-m // BLOCK), -(-n // BLOCK)
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rb, cb), dtype=torch.float32, device=x.device)
    pad = torch.zeros((rb * BLOCK, cb * BLOCK), dtype=x.dtype, device=x.device)
    quantize_into(x, q, s, pad)
    return q, s


def quantize_full(spec: ModelSpec, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference FP8 logical tensors: quantized weights and their scales; others as is."""
    out = dict(full)
    for t in spec.tensors:
        if is_quantized(t) and t.name in full:
            out[t.name], out[t.name + SCALE_SUFFIX] = quantize_block128(full[t.name])
    return out
