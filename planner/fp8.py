"""Block-FP8 targets (`target.dtype: fp8_block128`): e4m3 weights in 128x128 blocks, each
block with a float32 `weight_scale_inv`, as DeepSeek-V3, Kimi-K2 and Qwen3-FP8 serve.

Two pieces, all data (no torch: the compiler imports this module):
- `with_scales(spec)`: the spec plus one logical scale tensor per quantized weight
  (`<weight>_scale_inv`, `[ceil(out/128), ceil(in/128)]`, float32), as FP8 checkpoints
  name them. Quantized weights are the linear projections (names ending in `proj.weight`
  or `proj_with_mqa.weight`); embeddings, lm_head, routers and norms stay bf16.
- `quantize_layout(layout, spec)`: a bf16 target layout -> its FP8 form. A physical
  tensor holding only quantized weights becomes `float8_e4m3fn` and gains a sibling
  `<name>_scale_inv` whose pieces are the weight pieces divided by 128 (vLLM's
  `weight_scale_inv`, `w13_weight_scale_inv`, ...). Every piece must be block-aligned in
  both the logical and the physical tensor (vLLM's own partition rule); else a
  ConfigError names the tensor and the key to change.

The quantizer itself (vLLM's `per_block_cast_to_fp8` formula) has one home, the executor
(`executor/quant.py`), which runs it on the sources; the references built on it
(`quantize_block128`, `quantize_full`) are in `harness.weights`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from planner.layouts.base import Layout, PhysicalTensor, Piece, PieceColumns, RankLayout
from planner.spec import LogicalTensor, ModelSpec
from schemas.config import ConfigError
from schemas.protocol import FP8_BLOCK as BLOCK

FP8 = "float8_e4m3fn"
SCALE_SUFFIX = "_scale_inv"


def is_quantized(t: LogicalTensor) -> bool:
    return len(t.shape) == 2 and not t.buffer and (
        t.name.endswith("proj.weight") or t.name.endswith("proj_with_mqa.weight"))


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-s // BLOCK) for s in shape)


def with_scales(spec: ModelSpec) -> ModelSpec:
    """The spec with a float32 scale tensor after every quantized weight."""
    out: list[LogicalTensor] = []
    for t in spec.tensors:
        out.append(t)
        if is_quantized(t):
            out.append(LogicalTensor(t.name + SCALE_SUFFIX, scale_shape(t.shape), "float32",
                                     t.layer, buffer=True, mtp=t.mtp))
    return replace(spec, tensors=tuple(out))


def _aligned(p: Piece, logical: tuple[int, ...]) -> bool:
    """Block-aligned: every cut of the box and of its place is on the 128-grid, except a
    box that ends where its logical dim ends."""
    for off, size, full in zip(p.offsets, p.sizes, logical):
        if off % BLOCK or (size % BLOCK and off + size != full):
            return False
    dims = p.phys_dims()
    return all(p.at[d] % BLOCK == 0 for d in dims)


def _dims(c: PieceColumns) -> set[int]:
    """The physical dims the pieces of `c` run along."""
    k, p = c.offsets.shape[1], c.at.shape[1]
    return set(c.dims if c.dims is not None else range(p - k, p))


def scale_tensor(pt: PhysicalTensor, spec_by_name: dict[str, LogicalTensor]
                  ) -> PhysicalTensor:
    dims = {d for p in pt.pieces for d in p.phys_dims()}
    shape = tuple(-(-s // BLOCK) if d in dims else s for d, s in enumerate(pt.shape))
    pieces = []
    for p in pt.pieces:
        logical = spec_by_name[p.tensor].shape
        if not _aligned(p, logical):
            raise ConfigError(
                f"target.dtype: fp8_block128 needs 128x128-block-aligned shards, but "
                f"{pt.name} holds {p.tensor} rows/cols {p.offsets} + {p.sizes} at {p.at}; "
                "use a target.tp (or ep) that keeps every shard a multiple of 128, or "
                "target.dtype: bfloat16")
        at = tuple(a // BLOCK if d in dims else a for d, a in enumerate(p.at))
        sizes = tuple(-(-(o + s) // BLOCK) - o // BLOCK for o, s in zip(p.offsets, p.sizes))
        pieces.append(Piece(p.tensor + SCALE_SUFFIX, tuple(o // BLOCK for o in p.offsets),
                            sizes, at, p.dims))
    return PhysicalTensor(pt.name + SCALE_SUFFIX, shape, "float32", tuple(pieces))


def _scale_columns(pt: PhysicalTensor, c: PieceColumns, shape: tuple[int, ...],
                   spec_by_name: dict[str, LogicalTensor]) -> PhysicalTensor:
    """`scale_tensor` of a tensor whose pieces are columns, column by column."""
    k = c.offsets.shape[1]
    dims = list(c.dims if c.dims is not None else range(c.at.shape[1] - k, c.at.shape[1]))
    full = np.array([spec_by_name[n].shape for n in c.names], dtype=np.int64).reshape(len(c), k)
    off, size, at = c.offsets, c.sizes, c.at
    ok = ((off % BLOCK == 0) & ((size % BLOCK == 0) | (off + size == full))).all(axis=1)
    ok &= (at[:, dims] % BLOCK == 0).all(axis=1)
    if not ok.all():
        scale_tensor(replace(pt, pieces=(c[int(np.argmin(ok))],)), spec_by_name)  # raises
    scaled = at.copy()
    scaled[:, dims] //= BLOCK
    return PhysicalTensor(pt.name + SCALE_SUFFIX, shape, "float32", PieceColumns(
        tuple(n + SCALE_SUFFIX for n in c.names), off // BLOCK,
        -(-(off + size) // BLOCK) - off // BLOCK, scaled, c.dims))


def quantize_layout(layout: Layout, spec: ModelSpec) -> Layout:
    """The FP8 form of a target layout built with bf16 weights."""
    by_name = spec.by_name
    cache: dict[int, tuple[PhysicalTensor, ...]] = {}

    def convert(pt: PhysicalTensor) -> tuple[PhysicalTensor, ...]:
        if id(pt) not in cache:
            c = pt.pieces
            names = c.names if isinstance(c, PieceColumns) else [p.tensor for p in c]
            quant = bool(names) and all(is_quantized(by_name[n]) for n in names)
            if not quant:
                cache[id(pt)] = (pt,)
            elif isinstance(c, PieceColumns):
                shape = tuple(-(-s // BLOCK) if d in _dims(c) else s
                              for d, s in enumerate(pt.shape))
                cache[id(pt)] = (replace(pt, dtype=FP8), _scale_columns(pt, c, shape, by_name))
            else:
                cache[id(pt)] = (replace(pt, dtype=FP8), scale_tensor(pt, by_name))
        return cache[id(pt)]

    ranks = tuple(RankLayout(r.rank, r.replica,
                             tuple(x for pt in r.tensors for x in convert(pt)))
                  for r in layout.ranks)
    return replace(layout, ranks=ranks)

