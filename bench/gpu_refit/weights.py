"""Deterministic weights: generated on the device piece by piece, checked bit-exactly."""

from __future__ import annotations

import hashlib


def tensor_key(name: str, seed: int) -> int:
    h = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def logical_values(shape, offsets, sizes, key: int, device, dtype):
    """The values of box (`offsets`, `sizes`) of a logical tensor of `shape`: a hash of the
    element's linear index, as exact bf16 numbers in [2^-9, 2^-1) with random signs."""
    import torch

    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    idx = torch.zeros((1,) * len(sizes), dtype=torch.int64, device=device)
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        view = [1] * len(sizes)
        view[d] = s
        ar = (torch.arange(o, o + s, dtype=torch.int64, device=device) * strides[d])
        idx = idx + ar.view(view)
    x = (idx * 2654435761 + key) & 0xFFFFFFFF
    del idx
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    x ^= x >> 15
    bits = (x & 0x807F) | ((118 + ((x >> 7) & 7)) << 7)
    del x
    bits = bits - ((bits & 0x8000) << 1)
    return bits.to(torch.int16).view(torch.bfloat16).to(dtype)


def fill_pieces(t, pt, spec, seed: int, chunk_elems: int = 1 << 27) -> None:
    """Write the logical values of every piece of physical tensor `pt` into `t`."""
    from harness.weights import piece_view

    by = spec.by_name
    for piece in pt.pieces:
        view = piece_view(t, piece)
        shape = by[piece.tensor].shape
        key = tensor_key(piece.tensor, seed)
        rows = piece.sizes[0] if piece.sizes else 1
        per_row = max(1, piece.numel // max(rows, 1))
        step = max(1, chunk_elems // per_row)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            off = (piece.offsets[0] + r0, *piece.offsets[1:])
            size = (r1 - r0, *piece.sizes[1:])
            view.narrow(0, r0, r1 - r0).copy_(
                logical_values(shape, off, size, key, t.device, t.dtype))


def generate(tensors: dict, rank_layout, spec, seed: int) -> None:
    for pt in rank_layout.tensors:
        t = tensors[pt.name]
        t.zero_()
        fill_pieces(t, pt, spec, seed)


def check_targets(tensors: dict, rank_layout, spec, seed: int,
                  fp8_counts: dict | None = None) -> list[str]:
    """Names of the tensors that differ (bit-exactly) from the reference. Block-FP8 tensors
    (and their `_scale_inv` siblings) are held to the reference quantizer
    (`check_fp8`); `fp8_counts` collects how many of their elements were checked where."""
    import torch

    bad = []
    counts = fp8_counts if fp8_counts is not None else {}
    for pt in rank_layout.tensors:
        t = tensors[pt.name]
        if pt.dtype == "float8_e4m3fn":
            scale = tensors[pt.name + "_scale_inv"]
            bad += [pt.name] if check_fp8(t, scale, pt, spec, seed, counts) else []
            continue
        if pt.name.endswith("_scale_inv") and pt.name[:-len("_scale_inv")] in tensors:
            continue  # checked with its weight
        want = torch.zeros_like(t)
        fill_pieces(want, pt, spec, seed)
        if not torch.equal(t.view(torch.int16) if t.dtype == torch.bfloat16 else t,
                           want.view(torch.int16) if t.dtype == torch.bfloat16 else want):
            bad.append(pt.name)
        del want
    return bad


def check_generator(spec, layout, local: int, seed: int) -> list[str]:
    """Dry run: the generator agrees with `harness.weights` from full logical tensors."""
    import torch

    from harness.weights import DTYPES, materialize

    full = {t.name: logical_values(t.shape, (0,) * len(t.shape), t.shape,
                                   tensor_key(t.name, seed), "cpu", DTYPES[t.dtype])
            for t in spec.tensors}
    ref = materialize(layout, full, ranks=[local])[local]
    mine = {pt.name: torch.empty(pt.shape, dtype=DTYPES[pt.dtype])
            for pt in layout.ranks[local].tensors}
    generate(mine, layout.ranks[local], spec, seed)
    return [n for n in ref if not torch.equal(ref[n], mine[n])]


def check_fp8(t, scale, pt, spec, seed: int, counts: dict) -> bool:
    """Whether a block-FP8 target tensor `t` (and its scales `scale`) differs from the
    reference quantizer (`harness.weights.quantize_block128`, vLLM's
    `per_block_cast_to_fp8`) applied to the bf16 logical box of each piece. Pieces are
    128-block-aligned (`planner.fp8`), so a piece's blocks are the logical tensor's.
    The reference runs on the CPU for the first `counts["cpu_budget"]` elements of the rank
    (default 2^27) and on this GPU after that (tests/planner/test_fp8_gpu.py holds the two
    equal bit for bit)."""
    import torch

    from harness.weights import piece_view, quantize_block128

    by = spec.by_name
    spieces = list(scale_pieces(pt, spec))
    differs = False
    for piece, sp in zip(pt.pieces, spieces):
        box = logical_values(by[piece.tensor].shape, piece.offsets, piece.sizes,
                             tensor_key(piece.tensor, seed), t.device, torch.bfloat16)
        cpu = counts.get("cpu", 0) + box.numel() <= counts.get("cpu_budget", 1 << 27)
        q_ref, s_ref = quantize_block128(box.cpu() if cpu else box)
        key = "cpu" if cpu else "gpu"
        counts[key] = counts.get(key, 0) + box.numel()
        q = piece_view(t, piece)
        s = piece_view(scale, sp)
        if cpu:
            q, s = q.cpu(), s.cpu()
        if not (torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
                and torch.equal(s.view(torch.int32), s_ref.view(torch.int32))):
            differs = True
        del box, q_ref, s_ref
    return differs


def scale_pieces(pt, spec):
    """The pieces of the `_scale_inv` sibling of FP8 tensor `pt`, in `pt`'s piece order."""
    from planner.fp8 import scale_tensor

    return scale_tensor(pt, spec.by_name).pieces
