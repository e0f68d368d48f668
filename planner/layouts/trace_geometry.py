"""The geometry of one recorded copy (no torch): which box of a checkpoint tensor lands
where in a parameter, from the two views' sizes, strides and storage offsets.

`planner/layouts/vllm_trace.py` sees `param_view.copy_(checkpoint_view)` with both views
into contiguous storages (a checkpoint stand-in, a parameter). A view is a box exactly
when each of its dims of extent > 1 runs along one distinct dim of its base (same stride);
`piece` turns the pair into a layout `Piece` (`planner/layouts/base.py`). A traced rank
travels (from a tracing worker, into the cache) as `encode_rank`'s plain rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from planner.errors import TraceError
from planner.layouts.base import PhysicalTensor, Piece


class View(NamedTuple):
    """A strided view into a contiguous base tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """Storage offset, in elements."""


def contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def unravel(offset: int, shape: tuple[int, ...]) -> list[int]:
    """The multi-index of element `offset` of a contiguous tensor of `shape`."""
    out = []
    for stride in contiguous_strides(shape):
        out.append(offset // stride)
        offset %= stride
    return out


def dim_map(view: View, shape: tuple[int, ...], what: str) -> list[int | None]:
    """For each dim of `view` (into a contiguous tensor of `shape`), the dim of that tensor
    it runs along (None where the view's extent is 1); refuses a view that is not a box."""
    strides = contiguous_strides(shape)
    out: list[int | None] = []
    for size, stride in zip(view.shape, view.stride):
        if size == 1:
            out.append(None)
            continue
        dims = [i for i, s in enumerate(strides) if s == stride and shape[i] > 1]
        if len(dims) != 1 or dims[0] in out:
            raise TraceError(f"target.layout: traced: {what} is copied through a view of "
                             f"strides {tuple(view.stride)} that is not a box; a traced "
                             "layout takes only views, slices, narrows and copies")
        out.append(dims[0])
    return out


def piece(name: str, lshape: tuple[int, ...], src: View, dst: View,
          pshape: tuple[int, ...], param: str) -> Piece:
    """The piece that `dst.copy_(src)` writes: the box of logical tensor `name` (shape
    `lshape`) -> its position in parameter `param` (shape `pshape`)."""
    if src.shape != dst.shape:
        raise TraceError(f"target.layout: traced: vLLM's loader broadcasts {name} "
                         f"{src.shape} into {param} {dst.shape}; a traced layout takes only "
                         "same-shape copies")
    lmap, pmap = dim_map(src, lshape, name), dim_map(dst, pshape, param)
    sizes, to_phys = [1] * len(lshape), {}
    for size, li, pi in zip(src.shape, lmap, pmap):
        if li is not None and pi is not None:
            sizes[li], to_phys[li] = size, pi
    lead = len(pshape) - len(lshape)
    if lead >= 0 and all(lead + i == j for i, j in to_phys.items()):
        dims = None  # the default: the trailing physical dims, in order
    else:
        free = iter(j for j in range(len(pshape)) if j not in to_phys.values())
        dims = tuple(to_phys[i] if i in to_phys else next(free, -1) for i in range(len(lshape)))
        if -1 in dims:
            raise TraceError(f"target.layout: traced: {name} {lshape} lands in {param} "
                             f"{pshape} with fewer dims; a traced layout takes only boxes")
    return Piece(name, tuple(unravel(src.offset, lshape)), tuple(sizes),
                 tuple(unravel(dst.offset, pshape)), dims)


def encode_rank(tensors: Sequence[PhysicalTensor]) -> list[Any]:
    """One rank as plain msgpack-able rows (the cache's, and the tracing workers')."""
    return [[t.name, list(t.shape), t.dtype,
             [[p.tensor, list(p.offsets), list(p.sizes), list(p.at),
               None if p.dims is None else list(p.dims)] for p in t.pieces]] for t in tensors]
