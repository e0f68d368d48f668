"""Build every rank's physical tensors of one side from full logical tensors.

Tests and the demo use it as the reference: the source tensors a trainer would hold and
the target tensors an engine must end up with. Padding (elements no piece covers) is zero.
"""

from __future__ import annotations

import torch

from planner.layouts.base import Layout, Piece

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


def random_full_tensors(spec, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random logical tensors for a model spec (tests and the demo); exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in spec.tensors:
        x = torch.randn(t.shape, generator=g, dtype=torch.float32) * scale
        out[t.name] = x.to(DTYPES[t.dtype])
    return out
